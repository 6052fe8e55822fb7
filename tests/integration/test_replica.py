"""Replica mode (LowDiff+): layer-wise gradient capture, a background replica applied step by step,
persisted as ordinary full checkpoints, resumed through recovery.resume — exactly."""
from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch
from lowdiff_helpers import build

import lowdiff
import recovery
from lowdiff.cli.demo import batch, state_digest
from lowdiff.persist import replica as replica_module
from lowdiff.store.manifest import read_manifest

HANG_GUARD_S = 60   # only against hangs; nothing is timed


def wrap_replica(directory, model, opt, sched, sampler, keep=3, **replica):
    replica = {"full_every": 3, **replica}
    return lowdiff.wrap(opt, model, directory, compressor=lowdiff.Dense(), scheduler=sched,
                        extra_state={"sampler": sampler}, schedule=lowdiff.Replica(**replica),
                        retention=lowdiff.KeepLast(keep))


def iteration(model, sampler, micro_batches=1, clip=False):
    """Forward/backward of ``micro_batches`` accumulated micro-batches (optionally clipped)."""
    model.train()
    for _ in range(micro_batches):
        x, y = batch(sampler, size=16)
        loss = torch.nn.functional.cross_entropy(model(x), y) / micro_batches
        loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)


def train(opt, model, sampler, steps, digests=None, sched=None, **kwargs):
    for _ in range(steps):
        iteration(model, sampler, **kwargs)
        opt.step()
        opt.zero_grad()
        if digests is not None:
            digests[len(digests) + 1] = state_digest(model, opt, sched, sampler)


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), what


def assert_replica_is_training(opt) -> None:
    replica = opt._replica
    for (name, a), b in zip(opt.model.state_dict().items(), replica.model.state_dict().values()):
        if name in dict(opt.model.named_parameters()):
            assert_bytes_equal(a, b, name)
    train_state, replica_state = opt.optimizer.state_dict(), replica.optimizer.state_dict()
    assert train_state["param_groups"] == replica_state["param_groups"]
    assert sorted(train_state["state"]) == sorted(replica_state["state"])
    for index, entries in train_state["state"].items():
        for key, value in entries.items():
            assert_bytes_equal(value, replica_state["state"][index][key], f"optimizer state {index}/{key}")


@pytest.mark.parametrize("clip", [False, True], ids=["hooks", "clipped"])
def test_replica_is_training_state_byte_for_byte(tmp_path, clip):
    model, opt, sched, sampler = build()
    opt = wrap_replica(tmp_path / "ckpt", model, opt, sched, sampler)
    train(opt, model, sampler, 12, clip=clip)
    opt.flush()
    assert_replica_is_training(opt)
    stats = opt.stats()["replica"]
    assert stats["applied_step"] == opt.durable_step == 12 and stats["lag_steps"] == 0
    n_params = len(list(model.parameters()))
    if clip:   # clipping changed every gradient after backward: step() re-copied them all
        assert stats["step_copies"] == 12 * n_params and stats["hook_copies"] == 0
    else:      # the hooks staged every gradient during backward; step() copied nothing
        assert stats["hook_copies"] == 12 * n_params and stats["step_copies"] == 0
    opt.close()


def test_gradient_accumulation_records_the_final_gradient(tmp_path):
    """Three micro-batches per step: the hooks fire three times per parameter, the last copy is
    the step's gradient. Training without lowdiff on the same data gives the same bytes."""
    model, opt, sched, sampler = build()
    opt = wrap_replica(tmp_path / "ckpt", model, opt, sched, sampler)
    train(opt, model, sampler, 8, micro_batches=3)
    opt.flush()
    assert_replica_is_training(opt)
    assert opt.stats()["replica"]["step_copies"] == 0
    opt.close()

    plain_model, plain_opt, plain_sched, plain_sampler = build()
    for _ in range(8):
        iteration(plain_model, plain_sampler, micro_batches=3)
        plain_opt.step()
        plain_sched.step()
        plain_opt.zero_grad()
    for (name, a), b in zip(model.state_dict().items(), plain_model.state_dict().values()):
        assert_bytes_equal(a, b, name)


def test_resume_from_replica_checkpoint_is_exact(tmp_path):
    """Every persisted replica carries the boundary objects of its own step: resuming at it (plus
    the differentials after it, at a flushed step) gives the state training had after that step
    (model, optimizer, scheduler, sampler, RNG), and training on from there gives the
    uninterrupted run's states. After close() the newest step is a replica: nothing to replay."""
    directory = tmp_path / "ckpt"
    model, opt, sched, sampler = build()
    opt = wrap_replica(directory, model, opt, sched, sampler, full_every=4, keep=6)
    digests: dict = {}
    train(opt, model, sampler, 14, digests=digests, sched=sched)
    opt.flush()
    assert opt.durable_step == 14
    train(opt, model, sampler, 6, digests=digests, sched=sched)
    opt.close()

    for step in (14, 20):
        model2, opt2, sched2, sampler2 = build()
        opt2 = wrap_replica(directory, model2, opt2, sched2, sampler2, full_every=4, keep=6)
        resumed = recovery.resume(directory, model2, opt2, step=step)
        assert resumed == step
        if step == 20:
            assert resumed.replayed == 0, "close() persisted the replica of the last step"
        assert state_digest(model2, opt2, sched2, sampler2) == digests[step]
        if step == 14:
            continued: dict = dict.fromkeys(range(1, 15))
            train(opt2, model2, sampler2, 6, digests=continued, sched=sched2)
            assert [continued[s] for s in range(15, 21)] == [digests[s] for s in range(15, 21)]
        opt2.close()


def test_differentials_hold_the_steps_no_replica_holds(tmp_path, monkeypatch):
    """A replica that is never persisted after the base (as behind a disk slower than training):
    every flushed step is still durable, through ordinary differential batches, and resuming a
    copy of the directory taken then is exact."""
    monkeypatch.setattr(replica_module.Replica, "_persist", lambda self, record: None)
    directory, copy = tmp_path / "ckpt", tmp_path / "copy"
    model, opt, sched, sampler = build()
    opt = wrap_replica(directory, model, opt, sched, sampler, batch_steps=4)
    digests: dict = {}
    train(opt, model, sampler, 10, digests=digests, sched=sched)
    opt.flush()
    assert opt.durable_step == 10
    # Records held for their batches keep their gradient sets: no more than the writer's bound
    # (max_pending_batches=2 batches of 4) plus the worker's (2) and the current one.
    assert opt.stats()["replica"]["gradient_sets"] <= 2 * 4 + 2 + 1
    shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("LOCK"))
    opt.close()
    manifest = read_manifest(copy)
    assert [f.step for f in manifest.fulls] == [0]
    assert [(b.first, b.last) for b in manifest.batches] == [(1, 4), (5, 8), (9, 10)]

    model2, opt2, sched2, sampler2 = build()
    opt2 = wrap_replica(copy, model2, opt2, sched2, sampler2)
    resumed = recovery.resume(copy, model2, opt2)
    assert resumed == 10 and resumed.replayed == 10
    assert state_digest(model2, opt2, sched2, sampler2) == digests[10]
    opt2.close()


def test_records_a_persisted_replica_holds_are_not_written(tmp_path):
    """Batches larger than the run: every record is still pending when close() persists the
    replica of the last step, which holds them all, so no differential reaches the disk."""
    directory = tmp_path / "ckpt"
    model, opt, sched, sampler = build()
    opt = wrap_replica(directory, model, opt, sched, sampler, batch_steps=100, full_every=5)
    train(opt, model, sampler, 12)
    opt.close()
    manifest = read_manifest(directory)
    assert manifest.batches == [] and max(f.step for f in manifest.fulls) == 12
    assert not list(directory.glob("*.ldd"))
    assert opt._session.diffs.steps_dropped == 12


def test_backpressure_bounds_steps_in_flight(tmp_path, monkeypatch):
    """A worker that cannot apply makes training wait once ``replica_inflight_steps`` captured
    steps are unapplied; the replica catches up exactly when it can."""
    gate = threading.Event()
    real_apply = replica_module.apply_record

    def gated_apply(*args, **kwargs):
        gate.wait(HANG_GUARD_S)
        return real_apply(*args, **kwargs)

    monkeypatch.setattr(replica_module, "apply_record", gated_apply)
    model, opt, sched, sampler = build()
    opt = wrap_replica(tmp_path / "ckpt", model, opt, sched, sampler, inflight_steps=3)
    done_steps = []

    def run():
        for step in range(8):
            iteration(model, sampler)
            opt.step()
            opt.zero_grad()
            done_steps.append(step + 1)

    trainer = threading.Thread(target=run)
    trainer.start()
    deadline = time.monotonic() + HANG_GUARD_S
    while not opt._replica.waiting and trainer.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert opt._replica.waiting, "training never waited for the gated replica"
    # Blocked inside step 4 (after its optimizer step, before handing it over): three captured
    # steps unapplied, and the gradient sets in use are theirs and step 4's.
    assert opt._replica.unapplied == 3 and len(done_steps) == 3
    assert opt._replica.staging.in_use() <= 4
    gate.set()
    trainer.join(HANG_GUARD_S)
    assert not trainer.is_alive()
    opt.flush()
    stats = opt.stats()["replica"]
    assert stats["max_inflight_steps"] <= 3 and stats["training_waits"] >= 1
    assert_replica_is_training(opt)
    opt.close()


def test_worker_error_surfaces_at_next_step(tmp_path, monkeypatch):
    real_apply = replica_module.apply_record

    def failing_apply(record, *args, **kwargs):
        if record.step == 3:
            raise RuntimeError("replica apply failed")
        return real_apply(record, *args, **kwargs)

    monkeypatch.setattr(replica_module, "apply_record", failing_apply)
    model, opt, sched, sampler = build()
    opt = wrap_replica(tmp_path / "ckpt", model, opt, sched, sampler)
    train(opt, model, sampler, 3)   # the worker fails on step 3, after step() returned
    with pytest.raises(RuntimeError, match="replica apply failed"):
        opt.flush()
    iteration(model, sampler)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):   # every later step() refuses, before the optimizer changes anything
        with pytest.raises(RuntimeError, match="replica apply failed"):
            opt.step()
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="replica apply failed"):
        opt.close()
    # The replica failed at step 3; the records of the steps it applied before are on disk.
    assert opt.durable_step == 2


def test_replica_needs_dense_and_fixed_full_every(tmp_path):
    model, opt, sched, _ = build()
    with pytest.raises(ValueError, match="Dense"):
        lowdiff.wrap(opt, model, tmp_path / "a", compressor=lowdiff.TopK(0.1), scheduler=sched,
                     schedule=lowdiff.Replica())
    with pytest.raises(ValueError, match="full_every"):
        lowdiff.wrap(opt, model, tmp_path / "b", compressor=lowdiff.Dense(), scheduler=sched,
                     schedule=lowdiff.Replica(full_every="auto"))


def test_outside_change_resyncs_the_replica(tmp_path):
    """A parameter changed outside step() is no step the replica sees: it adopts the training
    state at the end of that step and persists it, so it stays exact."""
    model, opt, sched, sampler = build()
    opt = wrap_replica(tmp_path / "ckpt", model, opt, sched, sampler)
    train(opt, model, sampler, 3)
    with torch.no_grad():
        next(model.parameters()).mul_(0.5)
    with pytest.warns(RuntimeWarning, match="outside step"):
        train(opt, model, sampler, 1)
    train(opt, model, sampler, 3)
    opt.flush()
    assert opt.stats()["replica"]["resyncs"] == 1
    assert_replica_is_training(opt)
    opt.close()

