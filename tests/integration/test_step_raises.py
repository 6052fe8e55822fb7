"""A step that raises leaves step_count, the live state and the record stream consistent: the loop
catches the exception and trains on; the directory then resumes to exactly the live state, and
step_count counts the steps that changed the parameters. Three places a step can fail: the inner
optimizer (before it changed anything), the scheduler lowdiff steps (after the optimizer did), an
extra_state object's state_dict() at the boundary. Dense and TopK."""
from __future__ import annotations

import pytest
import torch

import lowdiff
import recovery

STEPS, FAIL_AT = 9, 4          # the 4th call of the failing part raises


class Flaky:
    """Raises on the FAIL_AT-th call of ``tick()``, once."""

    def __init__(self, fail_at: int | None = FAIL_AT):
        self.calls, self.fail_at = 0, fail_at

    def tick(self):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")


class FlakySGD(torch.optim.SGD):
    def __init__(self, params, flaky, **options):
        super().__init__(params, **options)
        self.flaky = flaky

    @torch.no_grad()
    def step(self, closure=None):
        self.flaky.tick()               # a check that fails before any parameter changes
        return super().step(closure)


class FlakyState:
    def __init__(self, flaky: Flaky | None):
        self.flaky, self.value = flaky, 0

    def state_dict(self):
        if self.flaky is not None:
            self.flaky.tick()
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def build(where: str, flaky: Flaky):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    if where == "optimizer":
        opt = FlakySGD(model.parameters(), flaky, lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    def factor(epoch):
        if where == "scheduler" and epoch > 0:
            flaky.tick()
        return 1 / (1 + epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return model, opt, sched, {"state": FlakyState(flaky if where == "extra_state" else None)}


@pytest.mark.parametrize("compressor", ["dense", "topk"])
@pytest.mark.parametrize("where", ["optimizer", "scheduler", "extra_state"])
def test_training_on_after_a_failed_step_resumes_to_the_live_state(tmp_path, where, compressor):
    flaky = Flaky()
    model, opt, sched, extra = build(where, flaky)
    make = (lambda: lowdiff.TopK(0.5, min_numel=4)) if compressor == "topk" else lowdiff.Dense
    wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt", compressor=make(), scheduler=sched, extra_state=extra,
                           full_every=100, batch_steps=3)
    failures = 0
    for _ in range(STEPS):
        model(torch.randn(5, 4)).sum().backward()
        extra["state"].value += 1
        before = [p.clone() for p in model.parameters()]
        count = wrapped.step_count
        try:
            wrapped.step()
        except RuntimeError as error:
            assert "injected failure" in str(error)
            failures += 1
            changed = not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
            # step_count counts the parameter updates that happened, and only those
            assert wrapped.step_count == count + changed
        wrapped.zero_grad()
    assert failures == 1
    live_step = wrapped.step_count
    live = [t.clone() for t in model.state_dict().values()]
    live_opt = opt.state_dict()
    live_lr, live_rng = opt.param_groups[0]["lr"], torch.get_rng_state()
    wrapped.close()

    model2, opt2, sched2, extra2 = build(where, Flaky(fail_at=None))
    wrapped2 = lowdiff.wrap(opt2, model2, tmp_path / "ckpt", compressor=make(), scheduler=sched2,
                            extra_state=extra2, full_every=100, batch_steps=3)
    assert recovery.resume(tmp_path / "ckpt", model2, wrapped2) == live_step
    assert all(torch.equal(a, b) for a, b in zip(live, model2.state_dict().values()))
    for key, state in live_opt["state"].items():
        assert all(torch.equal(v, opt2.state_dict()["state"][key][k]) for k, v in state.items())
    assert opt2.param_groups[0]["lr"] == live_lr and torch.equal(torch.get_rng_state(), live_rng)
    assert extra2["state"].value == STEPS
    wrapped2.close()
