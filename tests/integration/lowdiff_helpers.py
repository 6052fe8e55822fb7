"""Helpers for the lowdiff integration tests (not a test module): a tiny in-process trainer."""
from __future__ import annotations

import random

import numpy as np
import torch

import lowdiff
import recovery
from lowdiff.cli.demo import ShuffledSampler, forward_backward

FULL_EVERY = 6
BATCH_STEPS = 3
KEEP_FULL = 4


def build():
    """A tiny model with BatchNorm and Dropout, AdamW + cosine schedule, a stateful sampler."""
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.BatchNorm1d(48), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(48, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
    return model, opt, sched, ShuffledSampler(size=1000, seed=0)


def wrap(directory, model, opt, sched, sampler, **options):
    if "schedule" not in options:
        options = {"full_every": FULL_EVERY, "batch_steps": BATCH_STEPS, **options}
    options = {"retention": lowdiff.KeepLast(KEEP_FULL), **options}
    return lowdiff.wrap(opt, model, directory, compressor=lowdiff.TopK(ratio=0.1, min_numel=256),
                        scheduler=sched, extra_state={"sampler": sampler}, **options)


def train_steps(model, opt, sched, sampler, start, stop, on_step=None):
    """Steps ``start+1 .. stop``: python, numpy and torch RNG, the sampler, BatchNorm and Dropout
    all feed into the state, so any of them restored wrongly changes the result."""
    for step in range(start, stop):
        forward_backward(model, sampler)
        opt.step()
        opt.zero_grad()
        if on_step:
            on_step(step + 1)


def reference_digests(steps: int) -> dict:
    """{step: state digest} of the uninterrupted run without lowdiff (same compression), from
    step 0 to ``steps``: what every resume of a ``wrap``/``train_steps`` run must reproduce."""
    from lowdiff.cli.demo import _compress_in_place, state_digest

    model, opt, sched, sampler = build()
    compressor = lowdiff.TopK(ratio=0.1, min_numel=256)
    digests = {0: state_digest(model, opt, sched, sampler)}
    for step in range(steps):
        forward_backward(model, sampler)
        _compress_in_place(opt, compressor)
        opt.step()
        sched.step()
        opt.zero_grad()
        digests[step + 1] = state_digest(model, opt, sched, sampler)
    return digests


def resumed_digest(directory, step=None):
    """Resume ``directory`` into freshly built objects (at ``step``; None: the newest) with the
    RNGs first moved away from any state a checkpoint holds, so that only what resume restores
    counts. Returns (what resume returned, digest of the restored state)."""
    from lowdiff.cli.demo import state_digest

    model, opt, sched, sampler = build()
    torch.manual_seed(4321)
    np.random.seed(4321)
    result = recovery.resume(str(directory), model, opt, scheduler=sched, extra_state={"sampler": sampler},
                             step=step)
    return result, state_digest(model, opt, sched, sampler)


def train_directory(directory: str, steps: int) -> str:
    """Train ``steps`` steps from scratch with per-step checkpoints into ``directory``."""
    model, opt, sched, sampler = build()
    opt = wrap(directory, model, opt, sched, sampler)
    recovery.resume(directory, model, opt)
    train_steps(model, opt, sched, sampler, 0, steps)
    opt.close()
    return directory


def train_on_loader(directory, model, loader, stop: int, *, full_every: int, batch_steps: int, compressor=None):
    """Wrap AdamW over ``model`` with ``loader`` in extra_state, resume what ``directory`` holds and
    train epoch after epoch to step ``stop``: the sample indices seen (the loader yields
    (x, y, index)) and the final model state. After a resume at an epoch's last batch the first
    pass may yield no batch; the loop goes on to the next epoch."""
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, directory,
                       compressor=compressor or lowdiff.Dense(), full_every=full_every, batch_steps=batch_steps,
                       extra_state={"data": loader})
    step = recovery.resume(directory, model, opt)
    seen: list = []
    while step < stop:
        for x, y, index in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            seen += index.tolist()
            if step == stop:
                break
    opt.close()
    return seen, [t.clone() for t in model.state_dict().values()]


def same_tensors(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def train_striped(directory, devices, stop, **options):
    """Resume (or start) the demo's training in ``directory`` with full checkpoints striped over
    ``devices`` as well (Options(stripe_dirs=...)), train to ``stop`` and close."""
    model, opt, sched, sampler = build()
    opt = wrap(str(directory), model, opt, sched, sampler,
               options=lowdiff.Options(stripe_dirs=tuple(str(d) for d in devices)), **options)
    start = recovery.resume(str(directory), model, opt)
    train_steps(model, opt, sched, sampler, start, stop)
    opt.close()


def manifest_json(directory) -> dict:
    """The manifest of ``directory`` as it lies in MANIFEST.json (the raw JSON)."""
    import json
    import os
    with open(os.path.join(directory, "MANIFEST.json")) as f:
        return json.load(f)["manifest"]
