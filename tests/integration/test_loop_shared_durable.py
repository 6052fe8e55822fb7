"""Issue #27, friction: with storage tiers, ``opt.durable_step`` is the local tier's; what survives
losing the local directory is ``opt.shared_durable_step``, which trails it by at most about
``Tiers(max_lag_steps=...)`` steps plus two batches (step() waits for the drainer beyond that). A
resume from the shared tier alone reaches the step it reported. Fails on the old code (no such
attribute)."""
from __future__ import annotations

import shutil

import torch

import lowdiff
import recovery

LAG, BATCH = 2, 2


def model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_shared_tiers_durable_step_is_exposed_and_bounded(tmp_path):
    local, shared = tmp_path / "local", tmp_path / "shared"
    model, opt = model_and_optimizer()
    opt = lowdiff.wrap(opt, model, local, full_every=4, batch_steps=BATCH,
                       tiers=lowdiff.Tiers(str(shared), max_lag_steps=LAG))
    seen = []
    for _ in range(12):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        seen.append((opt.durable_step, opt.shared_durable_step))
    assert all(s <= d <= s + LAG + 2 * BATCH + 1 for d, s in seen if s >= 0), seen
    opt.flush()
    assert opt.stats()["tiers"]["shared_durable_step"] == opt.shared_durable_step
    opt.close()
    assert opt.shared_durable_step == opt.durable_step == 12
    shutil.rmtree(local)                          # the node is lost
    model, plain = model_and_optimizer()
    assert recovery.resume(str(local), model, plain, shared_dir=str(shared)) == 12


def test_without_tiers_it_is_none(tmp_path):
    model, opt = model_and_optimizer()
    opt = lowdiff.wrap(opt, model, tmp_path)
    assert opt.shared_durable_step is None
    opt.close()
