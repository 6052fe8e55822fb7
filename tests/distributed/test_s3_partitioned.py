"""A partitioned run (torch.distributed: a rank directory per rank) with its shared tier in an
object store, on real gloo processes (tiers_worker.py) against a real moto server behind the
tests' proxy: each rank drains into ``s3://bucket/prefix/rank-NNNNN``; the bucket keeps the sets
its policy says (counting the sets every rank's commit lists); with the nodes' local tiers gone,
resume from the bucket alone gives the uninterrupted run's state exactly, in one process and with
2 ranks, also after a SIGKILL of the run. A single-process run cannot drain into the partitioned
prefix (nor the reverse)."""
import os
import shutil
import sys

import pytest
import torch

import lowdiff
import recovery
from lowdiff.cli import main as cli
from lowdiff.errors import CheckpointError

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration"))
import partition_worker  # noqa: E402
from s3_helpers import listing, open_uploads, s3, s3_server  # noqa: E402,F401 (fixtures)
from test_partitioned_tiers import STEPS, digests, ok, start_ranks, wait  # noqa: E402


def fulls_of(ns, prefix: str) -> list:
    import json

    keys = [k for k in listing(ns.client, ns.bucket, prefix) if "/MANIFEST-" in k and k.count("/") == 2]
    assert len(keys) == 1, keys
    body = json.loads(ns.client.get_object(Bucket=ns.bucket, Key=keys[0])["Body"].read())["bucket_manifest"]
    return sorted(f["step"] for f in body["manifest"]["manifest"]["fulls"])


def test_a_partitioned_run_drains_into_a_bucket_and_resumes_from_it_alone_exactly(s3, tmp_path):  # noqa: F811
    url = f"s3://{s3.bucket}/ddp"
    # Two nodes: each rank's local tier in a root of its own (neither sees the other's), so the
    # local tiers learn which sets are complete from the bucket.
    local = tmp_path / "node{rank}"
    # Beside it, the same run SIGKILLed (rank 1, and then rank 0) after step 10, into another prefix.
    crashed_url, crashed_local = f"s3://{s3.bucket}/crashed", tmp_path / "crashed{rank}"
    run, crashed = wait(start_ranks(local, url, tmp_path / "run", 2),
                        start_ranks(crashed_local, crashed_url, tmp_path / "crashed", 2, "--crash-at", "10",
                                    "--crash-ranks", "1"), timeout=300)
    ok(run)
    assert crashed[1][0] == -9
    ref = [digests(tmp_path / f"run-{rank}.txt")[2] for rank in range(2)]
    assert ref[0][STEPS][0] != ref[1][STEPS][0]      # per-rank state differs: equal digests are a real check
    for rank in range(2):
        # keep-last 2 counting complete sets (full sets every 4 steps: 0, 4, 8, 12); a rank whose
        # last commits came before the other's completed the sets keeps older ones (one per set the
        # other rank was behind: under load, two), never fewer than the two newest.
        fulls = fulls_of(s3, f"ddp/rank-{rank:05d}/")
        assert fulls[-2:] == [8, 12], fulls
    assert open_uploads(s3.client, s3.bucket) == []
    assert cli.main(["verify", url]) == 0                # the CLI reads the partitioned bucket
    assert cli.main(["export", url, "-o", str(tmp_path / "last.pt")]) == 0
    for rank in range(2):
        shutil.rmtree(str(local).format(rank=rank))     # the nodes are replaced
    # Another world size: one process, a plain optimizer, the shares of 2 ranks.
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    resumed = recovery.resume(tmp_path / "alone", model, opt, shared_dir=url)
    assert (int(resumed), resumed.tier, resumed.directory) == (STEPS, "shared", url)
    assert partition_worker.shared_digest(model, opt) == ref[0][STEPS][1]
    assert not (tmp_path / "alone").exists()
    # The same world size: 2 ranks on two new nodes resume from the bucket alone.
    (again,) = wait(start_ranks(tmp_path / "new{rank}", url, tmp_path / "resumed", 2, "--resume-only"), timeout=240)
    err = ok(again)
    assert "lowdiff-s3-" not in err, err
    for rank in range(2):
        start, tier, got = digests(tmp_path / f"resumed-{rank}.txt")
        assert (start, tier) == (STEPS, "shared")
        assert got[STEPS] == ref[rank][STEPS], f"rank {rank}: state at step {STEPS} differs"
    # The killed run's nodes are replaced: it resumes from its bucket alone, at a step it had
    # committed there, exactly, and trains on to the uninterrupted run's final state.
    for rank in range(2):
        shutil.rmtree(str(crashed_local).format(rank=rank))
    (after,) = wait(start_ranks(tmp_path / "later{rank}", crashed_url, tmp_path / "after", 2), timeout=240)
    ok(after)
    for rank in range(2):
        start, tier, got = digests(tmp_path / f"after-{rank}.txt")
        # (the bucket lags the local tiers by what was still being uploaded at the kill: this run's
        # resumed at step 4 here; on a loaded machine it may be less)
        assert start <= 10 and (tier == "shared" or start == 0), (start, tier)
        assert got[start] == ref[rank][start] and got[STEPS] == ref[rank][STEPS], f"rank {rank} differs"
        # (the resumed session's full sets every 4 steps from its start)
        assert fulls_of(s3, f"crashed/rank-{rank:05d}/")[-2:] == list(range(start, STEPS + 1, 4))[-2:]
    assert open_uploads(s3.client, s3.bucket) == []
    # One prefix, one layout: a single-process run is refused the partitioned prefix.
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match="is partitioned"):
        lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, tmp_path / "single",
                     tiers=lowdiff.Tiers(url))
