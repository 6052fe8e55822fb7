"""A full checkpoint that falls due while the previous one is still being written: with the
controller choosing the interval (Auto) it is put off until the writer is free — the differentials
hold every step meanwhile, so resuming stays exact — and a fixed interval is kept as given."""
from __future__ import annotations

import threading

import torch

import lowdiff
import recovery
from lowdiff.store.manifest import read_manifest


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))


def _step(model, opt, step):
    g = torch.Generator().manual_seed(step)
    model(torch.randn(4, 8, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _run(directory, schedule, steps, hold_writer_at=None, release_after_s=None):
    """Train ``steps`` steps; from step ``hold_writer_at`` on the full writer's thread is busy (as
    a slow disk would hold it) until the end of the run, or for ``release_after_s`` seconds."""
    model = _model()
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, str(directory),
                       compressor=lowdiff.Dense(), schedule=schedule, retention=lowdiff.KeepAll())
    release = threading.Event()
    try:
        for step in range(steps):
            if hold_writer_at is not None and step <= hold_writer_at:
                opt.flush()   # the writer is free until the hold
            if step == hold_writer_at:
                opt._fulls._worker.submit(release.wait)   # the writer is busy until release
                if release_after_s is not None:
                    threading.Timer(release_after_s, release.set).start()
            opt.controller.full_every = 2       # as if the controller had chosen 2 (every step: it may re-decide)
            _step(model, opt, step)
        deferred = opt.stats()["fulls_deferred"]
    finally:
        release.set()
        opt.close()
    return model, deferred


def test_auto_interval_defers_a_full_checkpoint_while_the_writer_is_busy(tmp_path):
    # (released after 30 s at the latest: a writer that waited for it would fail, not hang, this test)
    model, deferred = _run(tmp_path / "auto", lowdiff.Auto(full_every="auto", batch_steps=1), 10, hold_writer_at=4,
                           release_after_s=30)
    fulls = sorted(f.step for f in read_manifest(str(tmp_path / "auto")).fulls)
    # Taken at 2 and 4; due from 6 on while the writer was held from step 4: put off, every step.
    assert fulls == [0, 2, 4] and deferred == 10 - 5, (deferred, fulls)
    ref, _ = _run(tmp_path / "ref", lowdiff.Auto(full_every="auto", batch_steps=1), 10)
    resumed = _model()
    opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    assert recovery.resume(str(tmp_path / "auto"), resumed, opt) == 10
    for a, b in zip(ref.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_fixed_interval_is_kept_as_given(tmp_path):
    # The writer is held from step 4 for a moment: the fixed schedule waits for it at the next
    # due full checkpoint (step 6) instead of putting it off.
    _, deferred = _run(tmp_path / "fixed", lowdiff.Fixed(full_every=2, batch_steps=1), 8, hold_writer_at=4,
                       release_after_s=0.3)
    assert sorted(f.step for f in read_manifest(str(tmp_path / "fixed")).fulls) == [0, 2, 4, 6, 8]
    assert deferred == 0
