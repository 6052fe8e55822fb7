"""Any LR scheduler passed to ``wrap(scheduler=...)`` — ones that cycle the momentum too, ones made
of other schedulers (SequentialLR, ChainedScheduler, which has no ``last_epoch`` of its own) —
resumes exactly: stopped, then resumed into new objects, the model, the optimizer's
hyper-parameters and the scheduler's state equal the uninterrupted run's byte for byte. One
stepped by the loop as well is named once."""
from __future__ import annotations

import pytest
import torch

import lowdiff
import recovery

S = torch.optim.lr_scheduler
TOTAL, STOP = 14, 6

SCHEDULERS = {
    "one-cycle": lambda opt: S.OneCycleLR(opt, max_lr=0.1, total_steps=30),
    "cyclic-momentum": lambda opt: S.CyclicLR(opt, 0.01, 0.1, step_size_up=3),
    "sequential": lambda opt: S.SequentialLR(opt, [S.LinearLR(opt, 0.1, total_iters=4), S.CosineAnnealingLR(opt, 10)],
                                             milestones=[4]),
    "chained": lambda opt: S.ChainedScheduler([S.ExponentialLR(opt, 0.9), S.StepLR(opt, 3, 0.5)]),
}


def run(directory, kind: str, stop: int, compressor):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = SCHEDULERS[kind](opt)
    wrapped = lowdiff.wrap(opt, model, directory, scheduler=sched, compressor=compressor, full_every=5,
                           batch_steps=2)
    step = recovery.resume(directory, model, wrapped)
    while step < stop:
        model(torch.randn(5, 4)).sum().backward()
        wrapped.step()
        wrapped.zero_grad()
        step += 1
    wrapped.close()
    groups = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    return [t.clone() for t in model.state_dict().values()], groups, sched.state_dict()


@pytest.mark.parametrize("kind", list(SCHEDULERS))
def test_a_scheduler_passed_to_wrap_resumes_exactly(tmp_path, kind):
    compressor = lowdiff.TopK(0.5, min_numel=4) if list(SCHEDULERS).index(kind) % 2 else lowdiff.Dense()
    want_model, want_groups, want_sched = run(tmp_path / "ref", kind, TOTAL, compressor)
    run(tmp_path / "ckpt", kind, STOP, compressor)
    got_model, got_groups, got_sched = run(tmp_path / "ckpt", kind, TOTAL, compressor)
    assert all(torch.equal(a, b) for a, b in zip(got_model, want_model, strict=True))
    assert got_groups == want_groups and got_sched == want_sched


def test_a_chained_scheduler_stepped_by_the_loop_too_is_named(tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = SCHEDULERS["chained"](opt)
    wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt", scheduler=sched)
    with pytest.warns(RuntimeWarning, match="ChainedScheduler.*twice per step"):
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            wrapped.step()
            wrapped.zero_grad()
            sched.step()
    wrapped.close()
