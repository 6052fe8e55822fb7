"""Killing a real training process and resuming it in a new one gives the exact training state.

The trainer is ``python -m lowdiff.cli.demo train`` (BatchNorm + Dropout, AdamW or SGD with Nesterov
momentum, CosineAnnealingLR passed as ``scheduler=``, a stateful sampler in ``extra_state``,
gradient clipping, python/numpy/torch RNG all used). It appends "step sha256" lines to a digests
file, the hash covering model, optimizer state, scheduler, sampler and RNG states byte for byte.
``python -m lowdiff.cli.demo reference`` is the same training without lowdiff (same compression).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from fault_helpers import REPO, env, read_digests
from lowdiff_helpers import build, train_steps, wrap

import recovery
from lowdiff.cli import main as cli
from lowdiff.cli.demo import state_digest

STEPS = 30
TIMEOUT_S = 240  # only against hangs; nothing is timed
CONFIGS = [("adamw", "topk"), ("sgd", "dense"), ("sgd", "topk"), ("adamw", "dense")]




def demo(mode, *args, digests, stderr):
    return subprocess.Popen([sys.executable, "-m", "lowdiff.cli.demo", mode, *args, "--digests", str(digests)],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, env=env(), cwd=REPO)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted runs, one per (optimizer, compressor), started together up front."""
    work = tmp_path_factory.mktemp("reference")
    procs = {}
    for optimizer, compressor in CONFIGS:
        path = work / f"{optimizer}-{compressor}.txt"
        log = open(work / f"{optimizer}-{compressor}.err", "w")
        procs[(optimizer, compressor)] = (path, log, demo(
            "reference", "--steps", str(STEPS), "--optimizer", optimizer, "--compressor", compressor,
            digests=path, stderr=log))
    cache = {}

    def get(optimizer, compressor) -> dict:
        key = (optimizer, compressor)
        if key not in cache:
            path, log, proc = procs[key]
            proc.communicate(timeout=TIMEOUT_S)
            log.close()
            assert proc.returncode == 0, Path(log.name).read_text()
            cache[key] = read_digests(path)
            assert sorted(cache[key]) == list(range(1, STEPS + 1))
        return cache[key]

    yield get
    for _path, log, proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.communicate()   # also closes its stdout pipe (a run whose digests no test asked for)
        log.close()


class Trainer:
    """One ``lowdiff.cli.demo train`` process on ``directory``."""

    def __init__(self, tmp_path, directory, optimizer, compressor, full_every, batch_steps, name):
        self.digests_path = tmp_path / f"{name}.digests"
        self.stderr = open(tmp_path / f"{name}.err", "w")
        self.lines: list[str] = []
        self.proc = demo("train", str(directory), "--steps", str(STEPS), "--optimizer", optimizer,
                         "--compressor", compressor, "--full-every", str(full_every),
                         "--batch-steps", str(batch_steps), digests=self.digests_path, stderr=self.stderr)

    def read_until(self, step: int) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith(f"step {step} "):
                return
        self.finish()
        raise AssertionError(f"the trainer exited ({self.proc.returncode}) before step {step}: "
                             f"{self.lines[-3:]} {Path(self.stderr.name).read_text()[-2000:]}")

    def kill(self, sig) -> None:
        os.kill(self.proc.pid, sig)

    def finish(self) -> int:
        try:
            out, _ = self.proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise AssertionError(f"the trainer hung after {self.lines[-1:]}") from None
        self.lines += out.splitlines()
        self.stderr.close()
        return self.proc.returncode

    @property
    def resumed_at(self) -> tuple[int, str | None]:
        for line in self.lines:
            if line.startswith("resumed at step "):
                _, _, _, step, digest = line.split()
                return int(step), digest
        return 0, None

    @property
    def last_printed_step(self) -> int:
        steps = [int(line.split()[1]) for line in self.lines if re.match(r"^step \d+ loss ", line)]
        return steps[-1] if steps else self.resumed_at[0]

    @property
    def digests(self) -> dict:
        return read_digests(self.digests_path)

    def stderr_text(self) -> str:
        return Path(self.stderr.name).read_text()


def check_resumed(trainer: Trainer, reference: dict) -> int:
    """The resumed process's state at the resumed step and every step after is the reference's."""
    step, digest = trainer.resumed_at
    assert step > 0, f"nothing was resumed: {trainer.lines[:2]}"
    assert digest == reference[step], f"state after resuming at step {step} differs from the reference"
    digests = trainer.digests
    assert sorted(digests) == list(range(step + 1, STEPS + 1))
    for s in range(step + 1, STEPS + 1):
        assert digests[s] == reference[s], f"resumed run diverged from the reference at step {s}"
    return step


def check_killed_run(trainer: Trainer, reference: dict, killed_at: int) -> None:
    """Up to the kill the checkpointed run is the reference run (lowdiff does not perturb training)."""
    digests = trainer.digests
    assert max(digests) >= killed_at
    for s, digest in digests.items():
        assert digest == reference[s], f"checkpointed run differs from the reference at step {s}"


def verifies(directory, capsys) -> bool:
    status = cli.main(["verify", str(directory)])
    out = capsys.readouterr().out
    assert status == 0, out
    return True


# ------------------------------------------------------------------ SIGKILL
KILL_CASES = [("adamw", "topk", 10, 4), ("sgd", "dense", 7, 3)]


@pytest.mark.parametrize("optimizer,compressor,full_every,batch_steps", KILL_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in KILL_CASES])
def test_sigkill_then_resume_is_exact(tmp_path, references, rng, capsys, optimizer, compressor, full_every,
                                      batch_steps):
    directory = tmp_path / "ckpt"
    kill_at = int(rng.integers(2 * batch_steps + 2, STEPS - 2))
    first = Trainer(tmp_path, directory, optimizer, compressor, full_every, batch_steps, "first")
    first.read_until(kill_at)
    first.kill(signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL

    second = Trainer(tmp_path, directory, optimizer, compressor, full_every, batch_steps, "second")
    assert second.finish() == 0, second.stderr_text()
    reference = references(optimizer, compressor)
    check_killed_run(first, reference, kill_at)
    resumed = check_resumed(second, reference)
    assert kill_at - resumed <= 2 * batch_steps + 1, \
        f"killed after step {kill_at}, resumed at {resumed}: more than two batches of {batch_steps} lost"
    # The kill may land after step k+1 handed over its record but before its digest was written.
    assert resumed <= max(first.digests) + 1, "resumed at a step the killed process never reached"
    assert verifies(directory, capsys)


def test_killed_twice_in_a_row_still_resumes_exactly(tmp_path, references, rng, capsys):
    optimizer, compressor, full_every, batch_steps = "sgd", "topk", 6, 3
    directory = tmp_path / "ckpt"
    reference = references(optimizer, compressor)

    first = Trainer(tmp_path, directory, optimizer, compressor, full_every, batch_steps, "first")
    kill_at = int(rng.integers(2 * batch_steps + 2, STEPS // 2))
    first.read_until(kill_at)
    first.kill(signal.SIGKILL)
    assert first.finish() == -signal.SIGKILL
    check_killed_run(first, reference, kill_at)

    # killed again soon after resuming: possibly before anything of the new session is durable
    second = Trainer(tmp_path, directory, optimizer, compressor, full_every, batch_steps, "second")
    for line in second.proc.stdout:
        second.lines.append(line.rstrip("\n"))
        if line.startswith("resumed at step") or line.startswith("step "):
            break
    resumed_first, digest = second.resumed_at
    assert 0 < resumed_first and kill_at - resumed_first <= 2 * batch_steps + 1
    assert digest == reference[resumed_first]
    kill_again = int(rng.integers(resumed_first + 1, min(STEPS - 1, resumed_first + 2 * batch_steps + 3)))
    second.read_until(kill_again)
    second.kill(signal.SIGKILL)
    assert second.finish() == -signal.SIGKILL
    check_killed_run(second, reference, kill_again)

    third = Trainer(tmp_path, directory, optimizer, compressor, full_every, batch_steps, "third")
    assert third.finish() == 0, third.stderr_text()
    resumed = check_resumed(third, reference)
    assert resumed >= resumed_first, "a second crash lost steps that were durable before it"
    assert kill_again - resumed <= 2 * batch_steps + 1
    assert verifies(directory, capsys)


# ------------------------------------------------------------------ SIGTERM
def test_sigterm_flushes_every_completed_step(tmp_path, references, rng, capsys):
    """With batches of 8 steps and no periodic full checkpoint, only the SIGTERM handler's flush
    can make the last steps durable."""
    optimizer, compressor, full_every, batch_steps = "adamw", "dense", 1000, 8
    directory = tmp_path / "ckpt"
    term_at = int(rng.integers(5, STEPS - 3))
    first = Trainer(tmp_path, directory, optimizer, compressor, full_every, batch_steps, "first")
    first.read_until(term_at)
    first.kill(signal.SIGTERM)
    assert first.finish() == -signal.SIGTERM, first.stderr_text()  # flushed, then died of SIGTERM
    printed = first.last_printed_step
    assert term_at <= printed < STEPS

    second = Trainer(tmp_path, directory, optimizer, compressor, full_every, batch_steps, "second")
    assert second.finish() == 0, second.stderr_text()
    reference = references(optimizer, compressor)
    check_killed_run(first, reference, printed)
    resumed = check_resumed(second, reference)
    # The signal may land inside step printed+1 after its record was handed over: that step is
    # complete and durable too, but was never printed.
    assert resumed in (printed, printed + 1), f"last printed step {printed}, resumed at {resumed}"
    assert resumed <= max(first.digests) + 1
    assert verifies(directory, capsys)


# ------------------------------------------------------------------ the window right after a base checkpoint
def _copy_as_a_kill_would_leave_it(opt, directory, copy):
    """The base full checkpoint is committed, no differential batch yet: what SIGKILL leaves there."""
    opt._fulls.wait()
    assert not [n for n in os.listdir(directory) if n.endswith(".ldd")]
    shutil.copytree(directory, copy)


def _resume_digest(directory):
    model, opt, sched, sampler = build()
    torch.manual_seed(777)
    np.random.seed(777)
    step = recovery.resume(str(directory), model, opt, scheduler=sched, extra_state={"sampler": sampler})
    return step, state_digest(model, opt, sched, sampler)


def test_killed_after_the_first_base_checkpoint(tmp_path):
    """The base checkpoint is written inside the first step(), after that step's forward pass drew
    random numbers, advanced the sampler and updated BatchNorm statistics; it must still hold the
    state before that step."""
    model, opt, sched, sampler = build()
    before = state_digest(model, opt, sched, sampler)
    opt = wrap(str(tmp_path / "ckpt"), model, opt, sched, sampler, batch_steps=50)
    try:
        assert recovery.resume(str(tmp_path / "ckpt"), model, opt) == 0
        train_steps(model, opt, sched, sampler, 0, 2)
        _copy_as_a_kill_would_leave_it(opt, tmp_path / "ckpt", tmp_path / "copy")
    finally:
        opt.close()
    assert _resume_digest(tmp_path / "copy") == (0, before)


def test_killed_after_the_base_checkpoint_of_a_resumed_session(tmp_path):
    model, opt, sched, sampler = build()
    opt = wrap(str(tmp_path / "ckpt"), model, opt, sched, sampler)
    digests = {}
    train_steps(model, opt, sched, sampler, 0, 8,
                lambda s: digests.setdefault(s, state_digest(model, opt, sched, sampler)))
    opt.close()

    model, opt, sched, sampler = build()
    opt = wrap(str(tmp_path / "ckpt"), model, opt, sched, sampler, batch_steps=50)
    try:
        assert recovery.resume(str(tmp_path / "ckpt"), model, opt) == 8
        train_steps(model, opt, sched, sampler, 8, 10)
        opt._fulls.wait()
        shutil.copytree(tmp_path / "ckpt", tmp_path / "copy")
    finally:
        opt.close()
    assert _resume_digest(tmp_path / "copy") == (8, digests[8])
