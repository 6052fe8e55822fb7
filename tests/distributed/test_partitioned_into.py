"""Resuming a partitioned directory reads the shared tensors straight into the caller's live
tensors, as a plain directory's full checkpoint is read: a model and an optimizer that has state
keep their very memory (every parameter and state tensor at its address), and equal the
uninterrupted run byte for byte, at the newest step and at a full checkpoint's own step; with 2
and 3 ranks whose optimizers have state, the shares received over the process group land in
those tensors too."""
import os
import sys

import pytest
import torch

import recovery

sys.path.insert(0, os.path.dirname(__file__))
import partition_worker  # noqa: E402
from partition_runs import STEPS, copy_directory, digests, launch, ok  # noqa: E402


def addresses(model, opt) -> list:
    return [p.data_ptr() for p in model.parameters()] + \
        [v.data_ptr() for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("step", [STEPS, 12], ids=["newest", "full-checkpoint-step"])
def test_shared_tensors_are_read_into_the_live_tensors(reference, step):
    ref, directory = reference
    torch.manual_seed(5)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()                                   # the optimizer has state: it can be read into
    opt.zero_grad()
    before = addresses(model, opt)
    start = recovery.resume(directory, model, opt, step=step)
    assert int(start) == step and start.full_step == 12
    assert addresses(model, opt) == before, "the restore put a tensor in new memory"
    assert partition_worker.shared_digest(model, opt) == ref[0][step][1]


def test_ranks_receive_the_shares_into_an_optimizer_that_has_state(tmp_path, reference):
    """2 and 3 ranks whose optimizers already stepped: each share is read by one rank and received
    by the others straight into their live tensors; every rank equals the uninterrupted run."""
    ref, directory = reference
    copy = copy_directory(directory, tmp_path / "ckpt")   # a wrapped optimizer resumes (and closes) in it
    for world in (2, 3):
        ok(launch(copy, tmp_path / f"w{world}", world, "--warm", "--resume-only"))
        for rank in range(world):
            step, got = digests(tmp_path / f"w{world}-{rank}.txt")
            assert step == STEPS and got[STEPS][1] == ref[0][STEPS][1], (world, rank)
            if rank < 2:
                assert got[STEPS] == ref[rank][STEPS], (world, rank)   # its own RNG, sampler, buffers too
