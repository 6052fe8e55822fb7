"""full_every="auto" and batch_steps="auto" run end to end, and resume stays exact."""
import torch

import lowdiff
import recovery


def run(directory, steps, *, resume):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, directory,
                       compressor=lowdiff.Dense(), full_every="auto", batch_steps="auto",
                       failure_rate_per_hour=3600.0)
    start = recovery.resume(directory, model, opt) if resume else 0
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(8, 16, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    decisions = opt.controller.describe()
    opt.close()
    return model, decisions, start


def test_auto_settings_measure_decide_and_resume_exactly(tmp_path):
    ref, decisions, _ = run(tmp_path / "ref", 40, resume=False)
    assert decisions["step_s"] is not None and decisions["persist_s"] is not None
    assert decisions["full_every"] >= 1 and 1 <= decisions["batch_steps"] <= 64
    run(tmp_path / "run", 23, resume=False)
    model, _, start = run(tmp_path / "run", 40, resume=True)
    assert start == 23
    for a, b in zip(ref.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
