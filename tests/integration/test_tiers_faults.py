"""Storage tiers under SIGKILL: a trainer staging to a shared tier (``python -m lowdiff.cli.demo train
--shared-dir``) is killed at a random point of a drain, a clean or a commit (``LOWDIFF_FAULT``,
lowdiff/faults.py), then restarted. Each time:

* resume lands on a state bit-identical to the uninterrupted run's, never older than the newest
  state that was durable in either tier when the process died;
* after the restart (whose cleaning may drop files drained since), neither tier is behind what it
  held, and every file each tier lists verifies;
* with the local tier deleted after the kill (a replaced node), resume from the shared tier is
  exact and never older than what was durable there.

A few trials run by default; ``pytest -m soak`` runs many.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from fault_helpers import Trainer, durable_step, raise_failures, run_scenarios, verify

from lowdiff.cli.demo import train

STEPS = 24
FULL_EVERY = 3
BATCH_STEPS = 2
PHASES = ("drain-write", "drain-commit", "clean", "manifest-write", "manifest-commit", "retention",
          "batch-commit", "full-commit")


@pytest.fixture(scope="module")
def reference() -> dict:
    before = torch.get_num_threads()
    torch.set_num_threads(1)   # as in the demo processes: the digests depend on it
    try:
        return train(None, STEPS, log=lambda m: None)["digests"]
    finally:
        torch.set_num_threads(before)


class TieredTrainer(Trainer):
    """The demo trainer with a shared tier (keep-last 2 on both tiers: every full cleans)."""

    def __init__(self, *args, shared: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.shared = shared

    def argv(self, digests):
        return super().argv(digests) + ["--shared-dir", self.shared, "--shared-policy", "last:2"]


def trial(name, tmp_path, rng, reference, drop_local: bool):
    """Kill during a random phase, check both tiers, optionally delete the local tier, restart."""
    local, shared = tmp_path / name / "local", tmp_path / name / "shared"
    local.parent.mkdir(parents=True)
    phase = str(rng.choice(PHASES))
    count = int(rng.integers(1, 12))
    crashed = yield TieredTrainer(str(local), str(tmp_path), f"{name}-crash", STEPS, FULL_EVERY, BATCH_STEPS,
                                  fault=f"{phase}:{count}", shared=str(shared))
    where = f"{name} ({phase}:{count}, exit {crashed.returncode})"
    assert crashed.returncode in (0, -9), f"{where}: {crashed.tail()}"
    durable = {"local": durable_step(local), "shared": durable_step(shared)}
    if drop_local:
        shutil.rmtree(local)
    # First a restart that only resumes (and lets the stores finish interrupted cleans), then checks.
    resumed = yield TieredTrainer(str(local), str(tmp_path), f"{name}-resume", 0, FULL_EVERY, BATCH_STEPS,
                                  shared=str(shared))
    assert resumed.returncode == 0, f"{where}: the restarted trainer failed: {resumed.tail()}"
    floor = durable["shared"] if drop_local else max(durable.values())
    start, digest = resumed.resumed or (0, None)
    assert start >= floor, f"{where}: resumed at step {start}, but step {floor} was durable ({durable})"
    if start:
        assert digest == reference[start], f"{where}: the state resumed at step {start} differs from the run's"
    # Cleaning went on at the restart (files drained since may leave the local tier), but no tier
    # went back, and every file each tier lists verifies.
    for tier in ("shared",) if drop_local else ("local", "shared"):
        directory = local if tier == "local" else shared
        assert durable_step(directory) >= durable[tier], f"{where}: the {tier} tier went back"
        status, lines = verify(directory)
        assert status == 0, f"{where}: the {tier} tier does not verify: {lines[-5:]}"
    finished = yield TieredTrainer(str(local), str(tmp_path), f"{name}-finish", STEPS, FULL_EVERY, BATCH_STEPS,
                                   shared=str(shared))
    assert finished.returncode == 0, f"{where}: the restarted trainer failed: {finished.tail()}"
    assert finished.final_digest(STEPS) == reference[STEPS], f"{where}: the run did not end in the reference state"
    return crashed.returncode == -9


def run_trials(tmp_path, seed, reference, trials):
    rng = np.random.default_rng(seed)
    scenarios = {f"t{n}": trial(f"t{n}", tmp_path, rng, reference, drop_local=bool(n % 3 == 2))
                 for n in range(trials)}
    raise_failures(run_scenarios(scenarios))


def test_sigkill_during_drain_clean_and_commit(tmp_path, rng, reference):
    run_trials(tmp_path, int(rng.integers(2**31)), reference, trials=3)   # one of them on a replaced node (t2)


@pytest.mark.soak
def test_sigkill_during_drain_clean_and_commit_soak(tmp_path, rng, reference):
    run_trials(tmp_path, int(rng.integers(2**31)), reference, trials=60)
