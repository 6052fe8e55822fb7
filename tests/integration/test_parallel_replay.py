"""Parallel replay: any number of decoding workers gives the same bytes as ``workers=1`` and as the
uninterrupted training, for several optimizers, TopK and Dense, and GradScaler-skipped steps; a
corrupted record in the middle ends the replay before it, whatever the worker count.
"""
from __future__ import annotations

import logging
import os

import pytest
import torch

import lowdiff
import recovery
from lowdiff.format.records import RECORD_HEADER
from lowdiff.store.manifest import read_manifest

STEPS = 25
BAD_STEPS = {4, 11}          # GradScaler skips these (infinite loss)


class GradInPlaceSGD(torch.optim.SGD):
    """Adds weight decay into ``.grad`` in place before its update, as some optimizers do: replay
    must not trust the gradient buffer to hold only what it wrote."""

    def step(self, closure=None):
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.add_(p, alpha=0.01)
        return super().step(closure)


class DropsGradsSGD(torch.optim.SGD):
    """Sets every ``.grad`` to None at the end of its step: replay must give them back."""

    def step(self, closure=None):
        loss = super().step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None
        return loss


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
    "sgd-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, weight_decay=0.05),
    "grad-in-place": lambda p: GradInPlaceSGD(p, lr=0.05, momentum=0.9),
    "drops-grads": lambda p: DropsGradsSGD(p, lr=0.05),
}


def build(optimizer: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = OPTIMIZERS[optimizer](model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=4)
    return model, opt, scaler


def state_of(model, opt) -> list:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for entry in opt.state_dict()["state"].values():
        tensors += [v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v) for v in entry.values()]
    return tensors


def train(directory, optimizer: str, compressor) -> list:
    """Train STEPS steps with per-step checkpoints (one full checkpoint only: a long chain)."""
    model, opt, scaler = build(optimizer)
    opt = lowdiff.wrap(opt, model, directory, compressor=compressor, full_every=1000, batch_steps=3,
                       grad_scaler=scaler)
    recovery.resume(directory, model, opt)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y) * (float("inf") if step + 1 in BAD_STEPS else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    opt.close()
    return state_of(model, opt)


def resumed(directory, optimizer, workers, **options):
    model, opt, scaler = build(optimizer)
    step = recovery.resume(directory, model, opt, grad_scaler=scaler, workers=workers, **options)
    return step, state_of(model, opt)


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("compressor", ["topk", "dense"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_any_worker_count_gives_the_training_state_byte_for_byte(tmp_path, optimizer, compressor):
    comp = lowdiff.TopK(ratio=0.1, min_numel=128) if compressor == "topk" else lowdiff.Dense()
    directory = str(tmp_path / "ckpt")
    trained = train(directory, optimizer, comp)
    results = {workers: resumed(directory, optimizer, workers) for workers in (1, 3, None)}
    for workers, (step, state) in results.items():
        assert step == STEPS and step.replayed == STEPS, (workers, step)
        assert same(state, trained), f"workers={workers} differs from training"
    assert results[1][0].skipped == ()


def test_a_corrupted_record_in_the_middle_ends_the_replay_before_it(tmp_path, caplog):
    directory = str(tmp_path / "ckpt")
    train(directory, "adam", lowdiff.TopK(ratio=0.1, min_numel=128))
    batch = next(b for b in read_manifest(directory).batches if b.first == 13)
    path = os.path.join(directory, batch.file)
    with open(path, "r+b") as f:      # flip a byte inside the second record (step 14) of that batch
        f.seek(16)
        header = f.read(RECORD_HEADER.size)
        _, _, _, _, packed, raw, _ = RECORD_HEADER.unpack(header)
        f.seek(16 + RECORD_HEADER.size + packed + raw + RECORD_HEADER.size + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    states = []
    for workers in (1, 4):
        with caplog.at_level(logging.WARNING, logger="lowdiff"):
            step, state = resumed(directory, "adam", workers)
        assert step == 13
        assert any(batch.file in r.getMessage() for r in caplog.records)
        states.append(state)
    assert same(*states)
    step, state = resumed(directory, "adam", 2, step=13)
    assert step == 13 and same(state, states[0])


def test_workers_must_be_positive(tmp_path):
    directory = str(tmp_path / "ckpt")
    train(directory, "sgd", lowdiff.Dense())
    with pytest.raises(ValueError, match="workers=0"):
        resumed(directory, "sgd", 0)


def test_records_in_flight_stay_within_the_window(tmp_path, monkeypatch):
    """Decoded records wait for the apply in a bounded window (4 per worker): a long chain never
    holds more than that in memory, however much faster the workers decode than the apply runs."""
    import recovery.pipeline.replay as replay_module
    from lowdiff.step.apply import GradientBuffers

    directory = str(tmp_path / "ckpt")
    trained = train(directory, "adam", lowdiff.Dense())
    held, most = [0], [0]
    load, apply = replay_module._load, GradientBuffers.apply

    def counting_load(*args):
        prepared = load(*args)
        held[0] += 1
        most[0] = max(most[0], held[0])
        return prepared

    def counting_apply(self, prepared, optimizer):
        held[0] -= 1
        return apply(self, prepared, optimizer)

    def slow_apply(self, prepared, optimizer):   # the apply is the bottleneck, as on a real model
        import time
        time.sleep(0.01)
        return counting_apply(self, prepared, optimizer)

    monkeypatch.setattr(replay_module, "_load", counting_load)
    monkeypatch.setattr(GradientBuffers, "apply", slow_apply)
    step, state = resumed(directory, "adam", 2)
    assert step == STEPS and same(state, trained)
    assert 1 <= most[0] <= 4 * 2, most[0]


def test_large_records_in_flight_stay_within_window_bytes(tmp_path, monkeypatch):
    """Records that hold WINDOW_BYTES between them limit the window to two (a dense record is the
    size of the model): the same resume, with fewer read buffers faulted in."""
    import recovery.pipeline.replay as replay_module
    from lowdiff.step.apply import GradientBuffers

    directory = str(tmp_path / "ckpt")
    trained = train(directory, "adam", lowdiff.Dense())
    monkeypatch.setattr(replay_module, "WINDOW_BYTES", 1)   # every record is "large"
    held, most = [0], [0]
    load, apply = replay_module._load, GradientBuffers.apply

    def counting_load(*args):
        held[0] += 1
        most[0] = max(most[0], held[0])
        return load(*args)

    def slow_apply(self, prepared, optimizer):
        import time
        time.sleep(0.01)
        held[0] -= 1
        return apply(self, prepared, optimizer)

    monkeypatch.setattr(replay_module, "_load", counting_load)
    monkeypatch.setattr(GradientBuffers, "apply", slow_apply)
    step, state = resumed(directory, "adam", 2)
    assert step == STEPS and same(state, trained)
    assert most[0] == 2, most[0]


def test_the_replays_steps_run_with_freed_memory_kept_and_it_ends_with_the_replay(tmp_path):
    from recovery.pipeline import heapreuse
    if not heapreuse.tuning_allowed():
        pytest.skip("malloc tuning is not available or switched off here")
    directory = str(tmp_path / "ckpt")
    trained = train(directory, "adam", lowdiff.TopK(ratio=0.1, min_numel=128))
    model, opt, scaler = build("adam")
    seen = []
    inner = opt.step

    def step(*args, **kwargs):
        seen.append(heapreuse.active())
        return inner(*args, **kwargs)
    opt.step = step
    assert recovery.resume(directory, model, opt, grad_scaler=scaler) == STEPS
    assert seen and all(seen), seen
    assert not heapreuse.active()
    assert same(state_of(model, opt), trained)


def test_resume_decodes_the_first_records_while_the_full_checkpoint_loads(tmp_path, monkeypatch):
    """The replay's decoders start before the full checkpoint is read (their work overlaps the
    load, which the optimizer's steps cannot), and the resumed state is still the trained one."""
    import threading

    from recovery import restore
    from recovery.pipeline import replay as replay_module
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, str(tmp_path),
                       compressor=lowdiff.TopK(ratio=0.25, min_numel=16), full_every=100, batch_steps=4)
    for step in range(10):
        g = torch.Generator().manual_seed(step)
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    trained = {k: v.clone() for k, v in model.state_dict().items()}

    decoding = threading.Event()
    real_load, real_load_full = replay_module._load, restore.load_full

    def load(*args, **kwargs):
        decoding.set()
        return real_load(*args, **kwargs)

    def load_full(*args, **kwargs):
        # Held until a record is being decoded: without the early start this waits in vain.
        assert decoding.wait(30), "no record was decoded while the full checkpoint loaded"
        return real_load_full(*args, **kwargs)
    monkeypatch.setattr(replay_module, "_load", load)
    monkeypatch.setattr(restore, "load_full", load_full)
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    resumed = recovery.resume(str(tmp_path), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2))
    assert resumed == 10 and resumed.replayed == 10
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, trained[key])
