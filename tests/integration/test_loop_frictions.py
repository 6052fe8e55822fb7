"""Issue #27, frictions a new user hits: a scheduler handed to recovery.resume but never to wrap
is refused (it restored nothing, silently); the refusal of a bare sampler or DataLoader in
extra_state names lowdiff.ResumableLoader. Each test fails on the old code."""
from __future__ import annotations

import pytest
import torch

import lowdiff
import recovery


def train(directory, steps, **wrap_options):
    model = torch.nn.Linear(2, 1)
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, directory, full_every=2, batch_steps=1,
                       **wrap_options)
    for _ in range(steps):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()


def test_a_scheduler_given_to_resume_but_not_to_wrap_is_refused_before_anything_changes(tmp_path):
    train(tmp_path, 3)
    model = torch.nn.Linear(2, 1)
    before = [p.clone() for p in model.parameters()]
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(inner, 1)
    with pytest.warns(RuntimeWarning, match="not given it"):
        opt = lowdiff.wrap(inner, model, tmp_path, full_every=2, batch_steps=1)
    model.load_state_dict(dict(zip(("weight", "bias"), before)))
    with pytest.raises(ValueError, match=r"recovery.resume\(scheduler=StepLR\): lowdiff.wrap was given no scheduler, "
                                         r"so the checkpoints hold no state of this one.*lowdiff.wrap\(\.\.\., "
                                         r"scheduler=\.\.\.\)"):
        recovery.resume(tmp_path, model, opt, scheduler=sched)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    opt.close()


@pytest.mark.parametrize("make", [lambda: torch.utils.data.RandomSampler(range(4)),
                                  lambda: torch.utils.data.DataLoader(range(4), shuffle=True)],
                         ids=["RandomSampler", "DataLoader"])
def test_a_bare_sampler_or_loader_in_extra_state_is_refused_naming_resumable_loader(tmp_path, make):
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"has no state_dict\(\)/load_state_dict\(\): to save the data order, pass "
                                        r"lowdiff.ResumableLoader\(DataLoader\(\.\.\.\)\) instead"):
        lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, tmp_path, extra_state={"data": make()})


def test_torchs_scheduler_warning_after_a_skipped_first_step_points_at_the_users_line(tmp_path):
    """A GradScaler that skips the first step: torch warns that the scheduler stepped before the
    optimizer. Without lowdiff the warning points at the loop's sched.step(); through lowdiff it
    pointed into lowdiff/train/wrapper.py. It now points at the loop's scaler.step(opt), explained."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(inner, 1)
    scaler = torch.amp.GradScaler("cpu")
    opt = lowdiff.wrap(inner, model, tmp_path, scheduler=sched, grad_scaler=scaler)
    loss = model(torch.ones(2, 4)).sum() * float("inf")
    scaler.scale(loss).backward()
    torchs = r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"
    with pytest.warns(UserWarning, match=torchs) as seen:
        scaler.step(opt)                                   # the user's line
    opt.close()
    assert [w.filename for w in seen] == [__file__]
    assert "(lowdiff: the GradScaler skipped step 1" in str(seen[0].message)


def test_resumable_loader_reads_its_seed_without_drawing_from_the_global_rng():
    """Issue #27, 1, in small: building the loader leaves the global RNG as it was (Lightning builds
    it after the resume restored that RNG); the seed still follows torch.manual_seed."""
    data = torch.utils.data.TensorDataset(torch.arange(8))
    seeds = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        before = torch.get_rng_state()
        loader = lowdiff.ResumableLoader(torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
        assert torch.equal(torch.get_rng_state(), before)
        seeds.append(loader.state_dict()["seed"])
    assert seeds[0] != seeds[1]
