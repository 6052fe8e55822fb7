"""The usual PyTorch loop with work after ``opt.step()``: an LR scheduler the loop steps itself, an
EMA (``AveragedModel``) updated after the step, a validation pass every few steps that draws random
numbers — all in ``extra_state``, with ``wrap(boundary="manual")`` and ``opt.boundary()`` after
that work, TopK. SIGKILLed while it runs and resumed by a new process, it equals the uninterrupted
run byte for byte: model, EMA weights, optimizer, scheduler, RNG."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

import lowdiff
import recovery

TOTAL = 24


def run(directory, stop: int = TOTAL):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    opt = lowdiff.wrap(opt, model, directory, compressor=lowdiff.TopK(0.3, min_numel=16), full_every=6,
                       batch_steps=2, extra_state={"scheduler": sched, "ema": ema},
                       options=lowdiff.Options(boundary="manual"))
    step = recovery.resume(directory, model, opt)
    while step < stop:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        sched.step()                          # the loop steps its scheduler, as PyTorch's examples do
        ema.update_parameters(model)
        step += 1
        if step % 4 == 0:                     # validation: the global RNG, dropout in train mode
            with torch.no_grad():
                model(torch.randn(4, 6)).sum()
        opt.boundary()
        print("step", step, flush=True)
    opt.close()
    return {"tensors": [t.clone() for m in (model, ema) for t in m.state_dict().values()],
            "optimizer": opt.optimizer.state_dict(), "scheduler": sched.state_dict(), "rng": torch.get_rng_state()}


TRAINER = """
import sys
sys.path.insert(0, {tests!r})
from test_work_after_step import run
run({directory!r})
"""


def test_sigkill_then_resume_equals_the_uninterrupted_run(tmp_path):
    want = run(str(tmp_path / "ref"))
    directory = str(tmp_path / "ckpt")
    script = TRAINER.format(tests=os.path.dirname(__file__), directory=directory)
    env = {**os.environ, "LOWDIFF_FAULT": "batch-commit:5"}     # SIGKILLs itself at the 5th batch commit
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    # The last complete line: with PYTHONUNBUFFERED (CI sets it) print writes "step", " ", "N" and
    # "\n" one by one, so the kill can land between them and leave "step" alone at the end.
    killed_at = int(proc.stdout.split(b"\n")[:-1][-1].split()[-1])
    got = run(directory)
    assert 0 < killed_at < TOTAL
    assert all(torch.equal(a, b) for a, b in zip(got["tensors"], want["tensors"], strict=True))
    for key, state in want["optimizer"]["state"].items():
        assert all(torch.equal(v, got["optimizer"]["state"][key][k]) for k, v in state.items())
    assert got["scheduler"] == want["scheduler"] and torch.equal(got["rng"], want["rng"])
