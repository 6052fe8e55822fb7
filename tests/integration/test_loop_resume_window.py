"""Issue #27, 2 and 3: what happens between ``recovery.resume`` and the first training forward is
compared with what happens between the next boundary and forward. A DataLoader iterator made after
the resume without ``generator=`` (the global RNG drawn once, at resume only), a validation pass
after every ``opt.step()`` that draws from the global RNG or forgets ``model.eval()`` (changed after
every step, but not after the resume): each is named in one warning that gives the cause and the
fix, and each resumed run really differs from the uninterrupted one. Loops a resumed run repeats
exactly (noise drawn at the top of the loop; the validation with the boundary marked after it; a
DataLoader with its own generator) are exact and not warned about. Each warning test fails on the
old code, which said nothing."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lowdiff
import recovery

STEPS, STOP = 5, 2


class Sampler(torch.utils.data.Sampler):
    """A user's stateful sampler: its own shuffle per epoch, its position saved in extra_state."""

    def __init__(self, n):
        self.n, self.epoch, self.position = n, 0, 0

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        while self.position < self.n:
            self.position += 1
            yield order[self.position - 1]
        self.epoch, self.position = self.epoch + 1, 0

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = state["epoch"], state["position"]


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.3),
                                torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def result(model, opt):
    return [t.clone() for t in model.state_dict().values()] + [torch.get_rng_state()]


def with_sampler(directory, stop, generator):
    """Data from a DataLoader over the user's sampler; ``generator``: the loader has one."""
    model, opt = model_and_optimizer()
    sampler = Sampler(24)   # 6 steps per epoch: the runs stay in the first one
    data = TensorDataset(torch.randn(24, 4, generator=torch.Generator().manual_seed(7)))
    loader = DataLoader(data, batch_size=4, sampler=sampler,
                        generator=torch.Generator().manual_seed(5) if generator else None)
    opt = lowdiff.wrap(opt, model, directory, full_every=4, batch_steps=2, extra_state={"sampler": sampler})
    step = recovery.resume(directory, model, opt)
    for (x,) in loader:
        if step == stop:
            break
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        step += 1
    opt.close()
    return result(model, opt)


def with_validation(directory, stop, how, boundary="step"):
    """Data from a generator of the loop's own; after every step, ``how``: "noise" draws the next
    step's noise from the global RNG at the top of the loop instead (a resumed run repeats it)."""
    model, opt = model_and_optimizer()
    opt = lowdiff.wrap(opt, model, directory, full_every=4, batch_steps=2, options=lowdiff.Options(boundary=boundary))
    step = recovery.resume(directory, model, opt)
    while step < stop:
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + step))
        if how == "noise":
            x = x + torch.randn(3, 4)
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if how == "global-rng":       # validation drawing its inputs from the global RNG
            model.eval()
            with torch.no_grad():
                model(torch.randn(5, 4))
            model.train()
        elif how == "no-eval":        # validation that forgets eval(): BatchNorm statistics move
            with torch.no_grad():
                model(torch.randn(5, 4, generator=torch.Generator().manual_seed(1)))
        if boundary == "manual":
            opt.boundary()
    opt.close()
    return result(model, opt)


def caught(run) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        value = run()
    return value, [str(w.message) for w in seen if "lowdiff" in str(w.message)]


def interrupted(tmp_path, train, *args, **kwargs):
    """(uninterrupted result, resumed result, the resumed run's lowdiff warnings); the run stopped
    at STOP says nothing."""
    want = train(str(tmp_path / "ref"), STEPS, *args, **kwargs)
    _, first = caught(lambda: train(str(tmp_path / "ckpt"), STOP, *args, **kwargs))
    assert first == []
    got, said = caught(lambda: train(str(tmp_path / "ckpt"), STEPS, *args, **kwargs))
    return want, got, said


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_dataloader_without_generator_made_after_the_resume_is_named(tmp_path):
    want, got, said = interrupted(tmp_path, with_sampler, False)
    assert not same(got, want)                     # the warning is about a real difference
    assert len(said) == 1, said
    assert "between recovery.resume() (which restored the state of step 2) and the first training forward" in said[0]
    assert "DataLoader iterator" in said[0] and "generator=" in said[0] and "lowdiff.ResumableLoader" in said[0]


def test_a_dataloader_with_its_own_generator_is_exact_and_not_named(tmp_path):
    want, got, said = interrupted(tmp_path, with_sampler, True)
    assert said == [] and same(got, want)


@pytest.mark.parametrize("how, named, fix", [
    ("global-rng", "the torch RNG was drawn from", "torch.Generator of your own"),
    # dropout runs in that validation too: the RNG is named first, then the buffers, in one warning
    ("no-eval", "the torch RNG was drawn from", "; and buffers '1.num_batches_tracked', '1.running_mean', "
                "'1.running_var' changed there too (to make that exact, put the model in eval()"),
])
def test_work_after_every_step_is_named_at_resume(tmp_path, how, named, fix):
    want, got, said = interrupted(tmp_path, with_validation, how)
    assert not same(got, want)
    assert len(said) == 1, said
    assert said[0].startswith(f"lowdiff: {named} between opt.step() of step 3 (the iteration boundary)")
    assert "did not redo it for step 2" in said[0] and fix in said[0] and 'boundary=\\"manual\\"' not in said[0]
    assert 'options=lowdiff.Options(boundary="manual") and call opt.boundary() once that work is done' in said[0]


@pytest.mark.parametrize("how, boundary", [("noise", "step"), ("global-rng", "manual"), ("no-eval", "manual")])
def test_work_a_resumed_run_repeats_is_exact_and_not_named(tmp_path, how, boundary):
    want, got, said = interrupted(tmp_path, with_validation, how, boundary)
    assert said == [] and same(got, want)
