"""Loop patterns lowdiff cannot make exact are refused at wrap() (before anything is written) or
named in a warning once: LBFGS, SparseAdam, sparse embeddings, a scheduler whose step needs a
metric, a scheduler lowdiff was not given, a scheduler stepped by the loop as well."""
from __future__ import annotations

import os
import warnings

import pytest
import torch

import lowdiff
import recovery


def model_and_opt(optimizer=torch.optim.SGD, **options):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    return model, optimizer(model.parameters(), lr=0.1, **options)


def train(opt, model, steps, *, scheduler=None):
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


@pytest.mark.parametrize("case", ["lbfgs", "sparse-adam", "sparse-embedding", "plateau"])
def test_what_cannot_be_replayed_is_refused_at_wrap_before_anything_is_written(tmp_path, case):
    directory = tmp_path / "ckpt"
    scheduler = None
    if case == "lbfgs":
        model, opt = model_and_opt(torch.optim.LBFGS)
        match = "LBFGS evaluates the closure several times"
    elif case == "sparse-adam":
        model = torch.nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SparseAdam(model.parameters())
        match = "SparseAdam needs sparse gradients"
    elif case == "sparse-embedding":
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        match = "'0' \\(Embedding\\) has sparse=True"
    else:
        model, opt = model_and_opt()
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        match = "ReduceLROnPlateau.*needs arguments.*extra_state"
    with pytest.raises((TypeError, ValueError), match=match):
        lowdiff.wrap(opt, model, directory, scheduler=scheduler)
    assert not os.path.exists(directory) or os.listdir(directory) == []


def test_work_after_the_step_resumes_exactly_with_a_manual_boundary(tmp_path):
    """The recipe the refusal names: ReduceLROnPlateau stepped by the loop after a validation pass
    that draws random numbers and runs BatchNorm in train mode, saved in extra_state, with the
    iteration boundary marked after that work. Killed and resumed mid-run, byte for byte."""
    def run(directory, stop):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5)
        opt = lowdiff.wrap(opt, model, directory, full_every=4, batch_steps=2, extra_state={"plateau": plateau},
                           options=lowdiff.Options(boundary="manual"))
        step = recovery.resume(directory, model, opt)
        while step < stop:
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            with torch.no_grad():                    # "validation": global RNG and BatchNorm statistics
                metric = float(model(torch.randn(5, 4)).mean().item() > 0) + step % 2
            plateau.step(metric)
            opt.boundary()
        opt.close()
        return [t.clone() for t in model.state_dict().values()], opt.param_groups[0]["lr"]
    want, lr = run(str(tmp_path / "ref"), 11)
    run(str(tmp_path / "ckpt"), 5)
    run(str(tmp_path / "ckpt"), 8)
    got, got_lr = run(str(tmp_path / "ckpt"), 11)
    assert lr < 0.1 and got_lr == lr and all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_same_loop_without_the_boundary_diverges_and_is_named(tmp_path):
    """Without boundary="manual", that loop is not exact; the scheduler stepped late is named."""
    torch.manual_seed(0)
    model, opt = model_and_opt()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)
    wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt", extra_state={"plateau": plateau})
    with pytest.warns(RuntimeWarning, match="plateau.*lag one step.*boundary"):
        for step in range(3):
            train(wrapped, model, 1)
            plateau.step(float(step))
    wrapped.close()


def test_manual_boundary_misuse_is_refused_before_anything_changes(tmp_path):
    model, opt = model_and_opt()
    wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt", options=lowdiff.Options(boundary="manual"))
    with pytest.raises(lowdiff.CheckpointError, match="without an opt.step"):
        wrapped.boundary()
    train(wrapped, model, 1)
    before = [p.clone() for p in model.parameters()]
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(lowdiff.CheckpointError, match="call opt.boundary"):
        wrapped.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and wrapped.step_count == 1
    wrapped.close()                                  # records the pending step
    assert recovery.resume(tmp_path / "ckpt", *model_and_opt()) == 1
    plain_model, plain_opt = model_and_opt()
    with lowdiff.wrap(plain_opt, plain_model, tmp_path / "other") as plain:
        with pytest.raises(lowdiff.CheckpointError, match="boundary=\"manual\""):
            plain.boundary()
    with pytest.raises(ValueError, match="boundary='later'"):
        lowdiff.wrap(plain_opt, plain_model, tmp_path / "third", options=lowdiff.Options(boundary="later"))


def test_a_scheduler_lowdiff_was_not_given_is_named(tmp_path):
    model, opt = model_and_opt()
    torch.optim.lr_scheduler.StepLR(opt, 2)
    with pytest.warns(RuntimeWarning, match="LR scheduler is attached to this optimizer but lowdiff was not given"):
        lowdiff.wrap(opt, model, tmp_path / "ckpt").close()


def test_a_scheduler_in_extra_state_is_not_warned_about(tmp_path):
    model, opt = model_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt", scheduler=sched)
        train(wrapped, model, 3)
        wrapped.close()


@pytest.mark.parametrize("given_as", ["scheduler", "extra_state"])
def test_a_scheduler_stepped_by_the_loop_is_named_once(tmp_path, given_as):
    model, opt = model_and_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    options = {"scheduler": sched} if given_as == "scheduler" else {"extra_state": {"sched": sched}}
    wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt", **options)
    with pytest.warns(RuntimeWarning) as caught:
        train(wrapped, model, 4, scheduler=sched)
    wrapped.close()
    messages = [str(w.message) for w in caught if "StepLR" in str(w.message)]
    assert len(messages) == 1, messages
    assert ("twice per step" if given_as == "scheduler" else "lag one step") in messages[0]


def test_an_ema_in_extra_state_updated_after_the_step_is_named_once(tmp_path):
    """Captured at the end of opt.step(), before the loop's update: a resumed EMA would lag one."""
    model, opt = model_and_opt()
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt", extra_state={"ema": ema})
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(4):
            train(wrapped, model, 1)
            ema.update_parameters(model)
    wrapped.close()
    messages = [str(w.message) for w in caught if "AveragedModel" in str(w.message)]
    assert len(messages) == 1, messages
    assert "extra_state['ema']" in messages[0] and "lag one update" in messages[0]
    assert 'boundary="manual"' in messages[0]


def test_a_sparse_gradient_changes_nothing_before_it_is_refused(tmp_path):
    """Seen at step(): refused before any gradient is compressed or any residual changes."""
    model, opt = model_and_opt()
    wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt", compressor=lowdiff.TopK(0.5))
    train(wrapped, model, 1)
    model(torch.randn(3, 4)).sum().backward()
    weight = model[0].weight
    dense = model[1].weight.grad.clone()
    weight.grad = weight.grad.to_sparse()
    with pytest.raises(TypeError, match="sparse gradient"):
        wrapped.step()
    assert torch.equal(model[1].weight.grad, dense) and wrapped.step_count == 1
    wrapped.close()


def test_a_grad_scaler_not_given_to_wrap_is_named_once(tmp_path):
    model, opt = model_and_opt()
    scaler = torch.amp.GradScaler("cpu")
    wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt")
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(3):
            scaler.scale(model(torch.randn(3, 4)).sum()).backward()
            scaler.step(wrapped)
            scaler.update()
            wrapped.zero_grad()
    wrapped.close()
    assert [str(w.message) for w in caught if "GradScaler" in str(w.message)] == [
        str(caught[0].message)] and "grad_scaler=" in str(caught[0].message)
    assert caught[0].filename == __file__          # points at the scaler.step(...) line


def test_a_grad_scaler_given_to_wrap_is_not_warned_about(tmp_path):
    model, opt = model_and_opt()
    scaler = torch.amp.GradScaler("cpu")
    with lowdiff.wrap(opt, model, tmp_path / "ckpt", grad_scaler=scaler) as wrapped:
        for _ in range(2):
            scaler.scale(model(torch.randn(3, 4)).sum()).backward()
            scaler.step(wrapped)
            scaler.update()
            wrapped.zero_grad()
