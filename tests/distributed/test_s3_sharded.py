"""FSDP2 (sharded state: each rank records its own DTensor chunks) with its shared tier in an
object store, on real gloo processes (fsdp2_worker.py) against a real moto server behind the tests'
proxy: each rank drains its share of every set into ``s3://bucket/prefix/rank-NNNNN``; with the
local tier gone, the bucket alone resumes every rank's state exactly at 2 ranks, and at 1 rank
(resharded: the new rank's chunks cut from both ranks' shares) the state gathered to full tensors is
the uninterrupted run's."""
import os
import shutil
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration"))
from s3_helpers import listing, open_uploads, s3, s3_server  # noqa: E402,F401 (fixtures)
from test_fsdp2_resume import STEPS, digests, launch, ok  # noqa: E402


# With -m soak: each half runs by default, a partitioned bucket resumed at 2 ranks and at 1
# (test_s3_partitioned.py) and an FSDP2 run drained into a shared tier and resumed from it alone
# (test_fsdp2_resume.py); the drainer copies a rank's files whatever their layout.
@pytest.mark.soak
def test_a_sharded_run_drains_into_a_bucket_and_resumes_from_it_alone(s3, tmp_path):  # noqa: F811
    url = f"s3://{s3.bucket}/fsdp2"
    ok(launch(tmp_path / "local", tmp_path / "run", 2, "--shared", url))
    reference = [digests(tmp_path / f"run-{rank}.txt")[1] for rank in range(2)]
    gathered = digests(tmp_path / "run-0.txt", column=-2)[1]
    assert reference[0][STEPS] != reference[1][STEPS]     # each rank's own chunks: equal digests are a real check
    for rank in range(2):
        assert any("/MANIFEST-" in key for key in listing(s3.client, s3.bucket, f"fsdp2/rank-{rank:05d}/"))
    assert open_uploads(s3.client, s3.bucket) == []
    shutil.rmtree(tmp_path / "local")                                         # the nodes are replaced
    err = ok(launch(tmp_path / "new", tmp_path / "res", 2, "--shared", url, "--resume-only"))
    assert "lowdiff-s3-" not in err, err
    for rank in range(2):
        step, got = digests(tmp_path / f"res-{rank}.txt")
        assert step == STEPS and got[STEPS] == reference[rank][STEPS], rank
    ok(launch(tmp_path / "one", tmp_path / "at1", 1, "--shared", url, "--resume-only"))
    step, got = digests(tmp_path / "at1-0.txt", column=-2)
    assert step == STEPS and got[STEPS] == gathered[STEPS]
