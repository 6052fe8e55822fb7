"""A partitioned run whose ranks stripe their shares over two drives each (docs/format.md, "More
drives than ranks") drains into an object store (real gloo processes, tiers_worker.py, against the
tests' moto server): SIGKILLed while a striped share's unstriped copy is being made for upload,
its nodes then replaced, it resumes from the bucket alone exactly (the bucket holds no stripe and
names no drive)."""
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration"))
from s3_helpers import listing, open_uploads, s3, s3_server  # noqa: E402,F401 (fixtures)
from test_partitioned_tiers import STEPS, digests, ok, start_ranks, wait  # noqa: E402


def test_striped_shares_killed_during_upload_then_resumed_from_the_bucket_alone(s3, tmp_path,  # noqa: F811
                                                                                 monkeypatch, reference):
    # Two nodes of one rank each (LOCAL_RANK 0 of 1, so each rank has both of its node's drives).
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    local, drive = tmp_path / "node{rank}", tmp_path / "node{rank}-nvme1"
    striped = ("--stripe-dirs", str(drive))
    url = f"s3://{s3.bucket}/striped"
    # The uninterrupted run: conftest.py's (partition_worker trains as tiers_worker does: the same
    # digests at every step, whatever the checkpoint settings), run once for the whole session.
    ref, _ = reference
    # Every drain-write point: the 13th is by commit order the unstriped copy of the share of step 12.
    monkeypatch.setenv("LOWDIFF_FAULT", "drain-write:13")
    (killed,) = wait(start_ranks(local, url, tmp_path / "killed", 2, *striped), timeout=300)
    monkeypatch.delenv("LOWDIFF_FAULT")
    assert any(code == -9 for code, _ in killed), killed
    for rank in range(2):
        home = tmp_path / f"node{rank}" / f"rank-{rank:05d}"
        manifest = json.loads((home / "MANIFEST.json").read_text())["manifest"]
        assert manifest["fulls"] and all(len(f["stripes"]) == 2 for f in manifest["fulls"]), manifest
    scratch = [n for rank in range(2) for n in os.listdir(tmp_path / f"node{rank}" / f"rank-{rank:05d}")
               if n.startswith(".upload-")]
    assert scratch, "the kill did not land in a striped share's upload"
    keys = listing(s3.client, s3.bucket, "striped/")
    assert keys and not any(k.endswith(".lds") for k in keys), keys   # shares go up unstriped
    for rank in range(2):   # the nodes are replaced: their drives are gone too
        shutil.rmtree(str(local).format(rank=rank))
        shutil.rmtree(str(drive).format(rank=rank))
    (after,) = wait(start_ranks(tmp_path / "new{rank}", url, tmp_path / "after", 2), timeout=300)
    ok(after)
    for rank in range(2):
        start, tier, got = digests(tmp_path / f"after-{rank}.txt")
        assert tier == "shared" and 0 < start <= 12, (start, tier)
        assert got[start] == ref[rank][start] and got[STEPS] == ref[rank][STEPS], f"rank {rank} differs"
    assert open_uploads(s3.client, s3.bucket) == []
