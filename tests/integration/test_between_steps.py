"""Random numbers drawn or buffers changed between an iteration boundary and the next training
forward at some steps but not at others (validation every few steps, an epoch starting with a
DataLoader that has no generator) are named in one warning; loops that do the same after every
step, and the same loops with the boundary marked after that work, are not warned about."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lowdiff
import recovery


def make(dropout=0.0):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(dropout),
                                torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def validate(model, how):
    """Every few steps: an evaluation that draws from the global RNG, or one that forgets eval()
    (BatchNorm statistics move; its inputs come from a generator of its own)."""
    if how == "global-rng":
        model.eval()
        with torch.no_grad():
            model(torch.randn(5, 4))
        model.train()
    else:
        with torch.no_grad():
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(1)))


def train(directory, validation, *, steps=9, every=3, boundary="step", dropout=0.0, resume=False):
    """Each step's data from a generator of the loop's own (as a DataLoader with generator= gives it)."""
    model, opt = make(dropout)
    opt = lowdiff.wrap(opt, model, directory, full_every=4, batch_steps=2,
                       options=lowdiff.Options(boundary=boundary))
    step = recovery.resume(directory, model, opt) if resume else 0
    while step < steps:
        model(torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + step))).sum().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if validation and step % every == 0:
            validate(model, validation)
        if boundary == "manual":
            opt.boundary()
    opt.close()
    return model, opt


def lowdiff_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "lowdiff" in str(w.message)]


def test_validation_drawing_the_global_rng_every_few_steps_is_named_once(tmp_path):
    messages = lowdiff_warnings(lambda: train(tmp_path / "ckpt", "global-rng", steps=12))
    assert len(messages) == 1, messages
    assert "the torch RNG was drawn from" in messages[0]
    assert "after step(s) 3 but not after step(s) 1, 2" in messages[0]
    assert 'boundary="manual"' in messages[0] and "torch.Generator" in messages[0]


def test_validation_in_train_mode_names_the_batchnorm_buffers(tmp_path):
    messages = lowdiff_warnings(lambda: train(tmp_path / "ckpt", "train-mode"))
    assert len(messages) == 1, messages
    assert "buffers '1.num_batches_tracked', '1.running_mean', '1.running_var' changed" in messages[0]
    assert "eval()" in messages[0] and "RNG" not in messages[0].split(" changed ")[0]


@pytest.mark.parametrize("validation", ["global-rng", "train-mode"])
def test_the_same_loops_with_the_boundary_after_the_work_are_quiet(tmp_path, validation):
    assert lowdiff_warnings(lambda: train(tmp_path / "ckpt", validation, boundary="manual", dropout=0.2)) == []


def test_loops_that_do_the_same_after_every_step_are_quiet(tmp_path):
    """Noise from the global RNG, dropout and BatchNorm in every step; a DataLoader with a
    generator over several epochs; a ResumableLoader: exact at every step, nothing to name."""
    def noise_every_step():
        model, opt = make(dropout=0.2)
        with lowdiff.wrap(opt, model, tmp_path / "noise", full_every=4, batch_steps=2) as wrapped:
            for _ in range(8):
                model(torch.randn(3, 4)).sum().backward()
                wrapped.step()
                wrapped.zero_grad()

    def loader_epochs(make_loader, name):
        model, opt = make(dropout=0.2)
        data = TensorDataset(torch.arange(32.0).reshape(8, 4))
        loader = make_loader(data)
        with lowdiff.wrap(opt, model, tmp_path / name, full_every=4, batch_steps=2,
                          extra_state={"data": loader} if isinstance(loader, lowdiff.ResumableLoader) else None) as w:
            for _ in range(3):
                for (x,) in loader:
                    model(x).sum().backward()
                    w.step()
                    w.zero_grad()

    assert lowdiff_warnings(noise_every_step) == []
    assert lowdiff_warnings(lambda: loader_epochs(lambda d: DataLoader(
        d, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3)), "generator")) == []
    assert lowdiff_warnings(lambda: loader_epochs(lambda d: lowdiff.ResumableLoader(
        DataLoader(d, batch_size=2, shuffle=True)), "resumable")) == []


def test_a_dataloader_without_generator_starting_each_epoch_is_named(tmp_path):
    """Each iter() draws its base seed from the global RNG as an epoch starts: after the last
    step of an epoch, not after the others."""
    model, opt = make()
    loader = DataLoader(TensorDataset(torch.arange(32.0).reshape(8, 4)), batch_size=2, shuffle=True)

    def run():
        with lowdiff.wrap(opt, model, tmp_path / "ckpt", full_every=4, batch_steps=2) as wrapped:
            for _ in range(3):
                for (x,) in loader:
                    model(x).sum().backward()
                    wrapped.step()
                    wrapped.zero_grad()
    messages = lowdiff_warnings(run)
    assert len(messages) == 1 and "torch RNG was drawn from" in messages[0], messages
    assert "after step(s) 4 but not after step(s) 1, 2, 3" in messages[0]


def test_what_is_named_is_what_breaks_exactness(tmp_path):
    """The validation loop with dropout, resumed at a step whose validation drew random numbers
    (3), differs from the uninterrupted run; resumed at one whose did not (4), it is exact; with
    the boundary after the validation it is exact at both."""
    def params(model):
        return [p.detach().clone() for p in model.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        want = params(train(tmp_path / "ref", "global-rng", dropout=0.5)[0])
        for stop, exact in ((3, False), (4, True)):
            directory = tmp_path / f"stop{stop}"
            train(directory, "global-rng", steps=stop, dropout=0.5)
            got = params(train(directory, "global-rng", dropout=0.5, resume=True)[0])
            assert all(torch.equal(a, b) for a, b in zip(got, want)) is exact, stop
    want = params(train(tmp_path / "manual-ref", "global-rng", boundary="manual", dropout=0.5)[0])
    for stop in (3, 4):
        directory = tmp_path / f"manual{stop}"
        train(directory, "global-rng", steps=stop, boundary="manual", dropout=0.5)
        got = params(train(directory, "global-rng", boundary="manual", dropout=0.5, resume=True)[0])
        assert all(torch.equal(a, b) for a, b in zip(got, want)), stop


def test_the_hook_is_removed_at_close_and_the_first_window_after_resume_is_not_judged(tmp_path):
    model, opt = make()
    wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt")
    assert len(model._forward_pre_hooks) == 1
    wrapped.close()
    assert len(model._forward_pre_hooks) == 0
    # Resumed after step 2, the loop's one-off work before its first step (here a validation
    # pass drawing random numbers) is not taken for work between steps; it is named as what it
    # is, a draw between the resume and the first forward that the uninterrupted run did not make
    # there (issue #27, 2: tests/integration/test_loop_resume_window.py).
    train(tmp_path / "run", None, steps=2)
    model, opt = make()
    wrapped = lowdiff.wrap(opt, model, tmp_path / "run", full_every=4, batch_steps=2)
    assert recovery.resume(tmp_path / "run", model, wrapped) == 2
    validate(model, "global-rng")
    data = torch.Generator().manual_seed(0)

    def run():
        for _ in range(4):
            model(torch.randn(3, 4, generator=data)).sum().backward()
            wrapped.step()
            wrapped.zero_grad()
        wrapped.close()
    messages = lowdiff_warnings(run)
    assert len(messages) == 1 and "between recovery.resume()" in messages[0], messages
    assert "but not after step(s)" not in messages[0]


@pytest.mark.parametrize("given", ["compiled", "inner"])
def test_torch_compile_with_the_hook(tmp_path, given):
    """The compiled module given to wrap: its hook runs outside the graph and still judges; the
    inner module given while a compiled wrapper calls it: the hook is traced as doing nothing
    (fullgraph=True compiles), so that loop is not judged."""
    model, opt = make()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    wrapped = lowdiff.wrap(opt, compiled if given == "compiled" else model, tmp_path / "ckpt")

    def run():
        for step in range(1, 8):
            compiled(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).sum().backward()
            wrapped.step()
            wrapped.zero_grad()
            if step % 3 == 0:
                validate(model, "train-mode")
        wrapped.close()
    messages = lowdiff_warnings(run)
    if given == "compiled":
        assert len(messages) == 1 and "'_orig_mod.1.running_mean'" in messages[0], messages
    else:
        assert messages == []
