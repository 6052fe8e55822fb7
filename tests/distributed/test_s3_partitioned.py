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


def chain_of(ns, prefix: str) -> list:
    """The batch files of ``prefix``'s newest commit, oldest first."""
    import json

    keys = [k for k in listing(ns.client, ns.bucket, prefix) if "/MANIFEST-" in k and k.count("/") == 2]
    assert len(keys) == 1, keys
    body = json.loads(ns.client.get_object(Bucket=ns.bucket, Key=keys[0])["Body"].read())["bucket_manifest"]
    return [b["file"] for b in sorted(body["manifest"]["manifest"]["batches"], key=lambda b: b["first"])]


def whole_gets(lines: list, key: str) -> list:
    """The proxy's lines of GETs of all of the object ``key`` (not of a range of it)."""
    return [line for line in lines if line.startswith("GET ") and f"/{key} " in line.replace("?", " ")
            and "[range" not in line]


def test_a_partitioned_resume_from_the_bucket_streams_what_each_rank_reads(s3, tmp_path):  # noqa: F811
    """Issue #26: a partitioned resume from the bucket alone starts replaying before the last
    batch object of a rank's chain is fetched, and a rank fetches only the objects it reads: at
    the same world size each batch object is fetched whole once (by its own rank), not by every
    rank. Read from the proxy's log at each rank's first replayed step (no timing); the resume is
    exact at 2 ranks and at 1."""
    url = f"s3://{s3.bucket}/stream"
    (run,) = wait(start_ranks(tmp_path / "node{rank}", url, tmp_path / "run", 2, "--full-every", "100"), timeout=240)
    ok(run)
    ref = [digests(tmp_path / f"run-{rank}.txt")[2] for rank in range(2)]
    chains = [chain_of(s3, f"stream/rank-{rank:05d}/") for rank in range(2)]
    # one full set (step 0), then a chain of at least 7 batch objects per rank (2 steps each, or 1 when a
    # flush wrote a batch early): longer than the replay's window of files in flight and the fetch's lookahead
    assert all(len(chain) >= STEPS // 2 for chain in chains), chains
    for rank in range(2):
        shutil.rmtree(tmp_path / f"node{rank}")
    s3.proxy.seen.clear()
    (again,) = wait(start_ranks(tmp_path / "new{rank}", url, tmp_path / "resumed", 2, "--resume-only",
                                "--full-every", "100", "--mark-replay"), timeout=240)
    ok(again)
    seen = list(s3.proxy.seen)
    for rank in range(2):
        start, tier, got = digests(tmp_path / f"resumed-{rank}.txt")
        assert (start, tier) == (STEPS, "shared") and got[STEPS] == ref[rank][STEPS], rank
        mark = next(i for i, line in enumerate(seen) if f"replay-rank-{rank}" in line)
        keys = [f"stream/rank-{rank:05d}/{name}" for name in chains[rank]]
        assert whole_gets(seen[:mark], keys[0]), seen[:mark]             # the replay began with the first
        assert not whole_gets(seen[:mark], keys[-1]), seen[:mark]        # before the last was fetched
        for key in keys:
            assert len(whole_gets(seen, key)) == 1, (key, whole_gets(seen, key))   # by its own rank only
    # One process reads both ranks' shares: the replay starts before either chain's last object.
    at_first_step: list = []
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.register_step_pre_hook(lambda *_: at_first_step.append(list(s3.proxy.seen)) if not at_first_step else None)
    s3.proxy.seen.clear()
    resumed = recovery.resume(tmp_path / "alone", model, opt, shared_dir=url)
    assert (int(resumed), resumed.tier) == (STEPS, "shared")
    assert partition_worker.shared_digest(model, opt) == ref[0][STEPS][1]
    for rank in range(2):
        assert not whole_gets(at_first_step[0], f"stream/rank-{rank:05d}/{chains[rank][-1]}"), at_first_step[0]
        assert len(whole_gets(s3.proxy.seen, f"stream/rank-{rank:05d}/{chains[rank][-1]}")) == 1
    # A store that stops answering for one rank's object fails the resume on both ranks, naming it
    # (after the restore: the ranks stay in step, none waits for the other forever).
    s3.proxy.fail("drop", 10_000, f"/stream/rank-00001/{chains[1][-1]}")
    (failed,) = wait(start_ranks(tmp_path / "other{rank}", url, tmp_path / "failed", 2, "--resume-only",
                                 "--full-every", "100", "--deadline-s", "1"), timeout=240)
    s3.proxy.rules.clear()
    for code, err in failed:
        assert code not in (0, -9) and "cannot be read now" in err and chains[1][-1] in err, (code, err[-2000:])
    # Time travel from the bucket: the chain planned by the files' indexes, replayed to step 5 only.
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert recovery.resume(tmp_path / "alone", model, opt, shared_dir=url, step=5) == 5
    assert partition_worker.shared_digest(model, opt) == ref[0][5][1]
    check_durable_step(s3, url, "stream")


def check_durable_step(ns, url: str, prefix: str) -> None:
    """``opt.shared_durable_step`` of a rank of a partitioned bucket (durable_in_bucket, what its
    BucketStore reports) is the step the newest complete set reaches by every rank's newest commit,
    not what this rank's share reaches: once rank 1's prefix commits nothing, no set is complete and
    nothing can be resumed from the bucket, which rank 0's share alone does not show. (Issue #26.)"""
    import types

    from lowdiff.tiers.bucket import read_bucket
    from lowdiff.tiers.bucketranks import durable_in_bucket
    from lowdiff.tiers.objectstore import ObjectStore, S3Client, parse_s3_url

    own = read_bucket(S3Client(parse_s3_url(f"{url}/rank-00000"), ObjectStore()))
    session = own.manifest.fulls[-1].session
    for partition in (types.SimpleNamespace(rank=0, world=2, session=session),      # the run's own session
                      types.SimpleNamespace(rank=0, world=1, session="another")):   # a later one's (counts by index)
        assert durable_in_bucket(partition, url, None)(own.manifest) == STEPS
    for key in listing(ns.client, ns.bucket, f"{prefix}/rank-00001/"):
        if "/MANIFEST-" in key:
            ns.client.delete_object(Bucket=ns.bucket, Key=key)
    assert own.manifest.durable_step() == STEPS          # this rank's share alone (what was reported before)
    assert durable_in_bucket(types.SimpleNamespace(rank=0, world=2, session=session), url, None)(own.manifest) == -1


def test_the_prefixes_of_dropped_ranks_go_once_the_smaller_run_has_a_complete_set(s3, tmp_path,  # noqa: F811
                                                                                   monkeypatch):
    """Issue #26: 2 ranks, then 1 (on the same local directory: its rank-00001 is a dropped rank's).
    The prefix rank-00001 stays while the smaller run has no complete set of its own (it may hold
    the only copy of a share of the newest one), and is gone from the bucket once it has, also when
    the first removal was SIGKILLed half-way (its commits went first: nothing committed is left
    naming what is gone); the bucket alone then resumes the smaller run's state exactly."""
    url = f"s3://{s3.bucket}/shrink"
    (run,) = wait(start_ranks(tmp_path / "local", url, tmp_path / "run", 2), timeout=240)
    ok(run)
    assert any("/MANIFEST-" in key for key in listing(s3.client, s3.bucket, "shrink/rank-00001/"))
    (idle,) = wait(start_ranks(tmp_path / "local", url, tmp_path / "idle", 1, "--resume-only"), timeout=240)
    ok(idle)
    assert digests(tmp_path / "idle-0.txt")[0] == STEPS
    assert any("/MANIFEST-" in key for key in listing(s3.client, s3.bucket, "shrink/rank-00001/"))   # not yet
    monkeypatch.setenv("LOWDIFF_FAULT", "dropped-prefix:1")     # after its first deletion: its commit
    (killed,) = wait(start_ranks(tmp_path / "local", url, tmp_path / "killed", 1, "--steps", str(STEPS + 4)),
                     timeout=240)
    assert killed[0][0] == -9, killed
    left = listing(s3.client, s3.bucket, "shrink/rank-00001/")
    assert left and not any("/MANIFEST-" in key for key in left), left
    monkeypatch.delenv("LOWDIFF_FAULT")
    # (its first set, of step 20: the killed session's set 16 counts for neither)
    (one,) = wait(start_ranks(tmp_path / "local", url, tmp_path / "one", 1, "--steps", str(STEPS + 8)), timeout=240)
    ok(one)
    assert listing(s3.client, s3.bucket, "shrink/rank-00001/") == {}
    assert [k.split("/")[1] for k in listing(s3.client, s3.bucket, "shrink/")] == ["rank-00000"] * len(
        listing(s3.client, s3.bucket, "shrink/"))
    assert open_uploads(s3.client, s3.bucket) == []
    shutil.rmtree(tmp_path / "local")
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    resumed = recovery.resume(tmp_path / "alone", model, opt, shared_dir=url)
    assert (int(resumed), resumed.tier) == (STEPS + 8, "shared")
    assert partition_worker.shared_digest(model, opt) == digests(tmp_path / "one-0.txt")[2][STEPS + 8][1]

