"""A GAN with one wrap per sub-model (the discriminator's Adam with Dense, the generator's Adam with
TopK, each in its own directory), noise and dropout from the global RNG: stopped and resumed, and
SIGKILLed and resumed, it equals the uninterrupted run byte for byte — both models, both
optimizers, the RNG. The recipe the guide gives: resume the wraps in the order their steps end an
iteration (the generator's last: its boundary is the iteration's end, the RNG it saved is the one
the next iteration starts from), and if a crash left them at different steps, resume all again at
the smaller one."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import torch

import lowdiff
import recovery

TOTAL = 14


def build(directory):
    torch.manual_seed(0)
    gen = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2))
    disc = torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.LeakyReLU(0.2), torch.nn.Dropout(0.2),
                               torch.nn.Linear(16, 1))
    opt_d = lowdiff.wrap(torch.optim.Adam(disc.parameters(), lr=2e-3, betas=(0.5, 0.9)), disc,
                         os.path.join(directory, "disc"), full_every=5, batch_steps=2)
    opt_g = lowdiff.wrap(torch.optim.Adam(gen.parameters(), lr=2e-3, betas=(0.5, 0.9)), gen,
                         os.path.join(directory, "gen"), compressor=lowdiff.TopK(0.4, min_numel=8),
                         full_every=4, batch_steps=3)
    return gen, disc, opt_g, opt_d


def resume_together(wraps) -> int:
    """The guide's recipe: ``wraps`` in the order their steps end an iteration."""
    steps = [int(recovery.resume(directory, model, opt)) for directory, model, opt in wraps]
    if len(set(steps)) > 1:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "lowdiff: resuming .* abandons steps", RuntimeWarning)
            steps = [int(recovery.resume(directory, model, opt, step=min(steps))) for directory, model, opt in wraps]
    return steps[0]


def run(directory, stop: int):
    gen, disc, opt_g, opt_d = build(directory)
    step = resume_together([(os.path.join(directory, "disc"), disc, opt_d),
                            (os.path.join(directory, "gen"), gen, opt_g)])
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    while step < stop:
        real = torch.randn(8, 2, generator=torch.Generator().manual_seed(step)) * 0.5 + 1
        fake = gen(torch.randn(8, 3))
        loss_d = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake.detach()), torch.zeros(8, 1))
        loss_d.backward()
        opt_d.step()
        opt_d.zero_grad()
        bce(disc(gen(torch.randn(8, 3))), torch.ones(8, 1)).backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()                  # the generator's loss reached the discriminator's gradients
        step += 1
        print("step", step, flush=True)
    opt_d.close()
    opt_g.close()
    return {"models": [t.clone() for m in (gen, disc) for t in m.state_dict().values()],
            "optimizers": [opt.optimizer.state_dict() for opt in (opt_g, opt_d)], "rng": torch.get_rng_state()}


def same(a, b):
    assert torch.equal(a["rng"], b["rng"])
    assert all(torch.equal(x, y) for x, y in zip(a["models"], b["models"], strict=True))
    for mine, theirs in zip(a["optimizers"], b["optimizers"], strict=True):
        for key, state in mine["state"].items():
            assert all(torch.equal(v, theirs["state"][key][k]) for k, v in state.items())
    return True


def test_stopped_twice_and_resumed_equals_the_uninterrupted_run(tmp_path):
    want = run(str(tmp_path / "ref"), TOTAL)
    run(str(tmp_path / "ckpt"), 5)
    run(str(tmp_path / "ckpt"), 9)
    assert same(run(str(tmp_path / "ckpt"), TOTAL), want)


TRAINER = """
import sys
sys.path.insert(0, {tests!r})
from test_gan import run
run({directory!r}, {total})
"""


def test_sigkill_then_resume_equals_the_uninterrupted_run(tmp_path):
    want = run(str(tmp_path / "ref"), TOTAL)
    directory = str(tmp_path / "ckpt")
    script = TRAINER.format(tests=os.path.dirname(__file__), directory=directory, total=TOTAL)
    env = {**os.environ, "LOWDIFF_FAULT": "batch-commit:5"}     # SIGKILLs itself at the 5th batch commit
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert b"step" in proc.stdout
    assert same(run(directory, TOTAL), want)
