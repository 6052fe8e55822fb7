"""A partitioned run (torch.distributed, a rank directory per rank) with its shared tier in an
object store is refused, clearly and alike on every rank, by wrap (2 real gloo ranks against a
real moto server) and by resume: the partitioned layout cannot drain into a bucket yet (the
bucket's retention would have to count complete sets across the ranks' prefixes)."""
import os
import sys

import pytest
import torch

import recovery
from lowdiff.errors import CheckpointError

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration"))
import partition_worker  # noqa: E402
from s3_helpers import listing, s3, s3_server  # noqa: E402,F401 (fixtures)
from test_partitioned_tiers import start_ranks, wait  # noqa: E402


def test_a_partitioned_run_with_an_s3_tier_is_refused_by_wrap_and_resume(s3, tmp_path, monkeypatch):  # noqa: F811
    url = f"s3://{s3.bucket}/ddp"
    monkeypatch.chdir(tmp_path)
    (results,) = wait(start_ranks(tmp_path / "local", url, tmp_path / "run", 2), timeout=120)
    for code, err in results:
        assert code != 0 and "a partitioned run (torch.distributed) cannot drain into an object store" in err, err
    assert listing(s3.client, s3.bucket, "ddp/") == {}          # nothing written to the bucket
    assert not (tmp_path / "s3:").exists()
    # A partitioned directory (the uninterrupted run of partition_worker, 2 ranks) and an s3://
    # shared tier given to resume: refused before anything is read.
    from partition_runs import launch, ok
    ok(launch(tmp_path / "ckpt", tmp_path / "ref", 2, steps=4))
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="is partitioned .* cannot be the object store"):
        recovery.resume(tmp_path / "ckpt", model, opt, shared_dir=url)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
