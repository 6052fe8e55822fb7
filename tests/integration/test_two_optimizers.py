"""Several optimizers over one model, each wrapped with the whole model (e.g. AdamW for the
matrices and SGD for the rest): each directory holds its own optimizer's parameters, so resuming
both gives the uninterrupted run's state byte for byte, and neither sees the other's updates as a
change outside its step."""
from __future__ import annotations

import torch

import lowdiff
import recovery

STEPS = 12


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 2))
    matrices = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return model, torch.optim.AdamW(matrices, lr=1e-2), torch.optim.SGD(rest, lr=0.05, momentum=0.9)


def run(directory, stop: int):
    model, adamw, sgd = build()
    first = lowdiff.wrap(adamw, model, directory / "matrices", compressor=lowdiff.TopK(0.3), full_every=5,
                         batch_steps=2)
    second = lowdiff.wrap(sgd, model, directory / "rest", full_every=4, batch_steps=3)
    step = recovery.resume(directory / "matrices", model, first)
    assert recovery.resume(directory / "rest", model, second) == step
    while step < stop:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        step += 1
    changes = first.outside_changes + second.outside_changes
    first.close()
    second.close()
    return [t.clone() for t in model.state_dict().values()], changes


def test_two_optimizers_over_one_model_resume_exactly(tmp_path):
    want, changes = run(tmp_path / "ref", STEPS)
    assert changes == 0
    run(tmp_path / "ckpt", 7)
    got, changes = run(tmp_path / "ckpt", STEPS)
    assert changes == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_each_directory_holds_only_its_optimizers_parameters(tmp_path):
    run(tmp_path / "ckpt", 3)
    model, adamw, sgd = build()
    from lowdiff.format.fullckpt import load_full
    from lowdiff.store.manifest import read_manifest
    for name, optimizer in (("matrices", adamw), ("rest", sgd)):
        directory = tmp_path / "ckpt" / name
        full = read_manifest(str(directory)).fulls[-1]
        _, state = load_full(str(directory / full.file))
        mine = {key for key, value in model.state_dict(keep_vars=True).items()
                if any(value is p for group in optimizer.param_groups for p in group["params"])}
        params = {key for key, value in model.state_dict(keep_vars=True).items()
                  if isinstance(value, torch.nn.Parameter)}
        assert params & set(state.model) == mine, name
        assert "1.running_mean" in state.model      # buffers are in both
