"""The controller: measures what checkpointing costs in this process and picks the full-checkpoint
interval (``full_every``), the differential batch size (``batch_steps``) and, only with
``differentials="auto"`` (the user's consent to give up per-step durability), whether differentials
are recorded at all — whatever minimises the expected wasted time under the failure rate the user
states (lowdiff.control.costmodel; derivation in docs/controller.md). With fixed settings it measures and
reports, and changes nothing.

``Controller`` is the facade the rest of lowdiff calls; the work is in two parts: the cost meter
(lowdiff.control.meter: samples, the costs derived from them, what CONTROLLER.json keeps) and the
policy (lowdiff.control.policy: learning phase, probes, hysteresis — pure, also driven by
experiments/tune_frequency.py). The facade connects them, stamps decisions with the clock, logs
them and keeps CONTROLLER.json current.

Measurements outlive the process: they are written to CONTROLLER.json beside the manifest after
each full checkpoint, after each applied decision and after each probe (at the next batch write)
(lowdiff.control.controlstate) and read back when a session opens the directory, and
``recovery.resume`` reports what a restart really cost (``resumed``): load, replay per record and
the restart itself (process start to the end of resume, minus load and replay).

Decisions are re-solved after every full checkpoint persists and every ``RESOLVE_EVERY_BATCHES``
batches, and applied only when the new optimum is predicted to waste clearly less than the settings
in force (hysteresis), or when those settings break a constraint. Each applied decision is logged
(logger "lowdiff", INFO) with its inputs and kept in ``history``.

Thread safety: the training thread, the diff-writer thread and the full-writer thread all report
to one Controller; its lock guards the policy and every report that reaches it (the meter has its
own lock, always taken after this one). ``full_every``, ``batch_steps`` and ``differentials`` are
read without it: each is one value, replaced whole, and any value is safe to act on (a batch closes
at whatever size it has; a full checkpoint is due when the interval in force says).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import warnings
from typing import Any

from lowdiff.control.controlstate import CONTROLLER_NAME, UnusableState
from lowdiff.control.costmodel import Costs, Evaluation, Limits
from lowdiff.control.meter import CostMeter, Window, process_age_s
from lowdiff.control.policy import (
    AUTO_INITIAL_BATCH_STEPS,
    AUTO_INITIAL_FULL_EVERY,
    MAX_BATCH_STEPS,
    MAX_FULL_EVERY,
    PROBE_MIN_FULL_EVERY,
    RESOLVE_EVERY_BATCHES,
    Decision,
    Policy,
    choose,
)

# (Names other modules and tests import from here.)
__all__ = ["AUTO_INITIAL_BATCH_STEPS", "AUTO_INITIAL_FULL_EVERY", "PROBE_MIN_FULL_EVERY", "RESOLVE_EVERY_BATCHES",
           "Controller", "Decision", "choose", "process_age_s"]

log = logging.getLogger("lowdiff")


def _of_policy(name: str, doc: str, writable: bool = False) -> Any:
    """A Controller attribute that is its policy's (the facade keeps the names its callers use).
    (A property, typed Any so that each attribute's annotation in the class states its type.)"""
    return property(lambda self: getattr(self.policy, name),
                    (lambda self, value: setattr(self.policy, name, value)) if writable else None, doc=doc)


class Controller:
    """The measurements of one run and the settings chosen from them (see the module docstring):
    ``meter`` (a CostMeter) and ``policy`` (a Policy) behind one lock."""

    def __init__(self, config):
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self.limits = Limits(failure_rate_per_s=config.failure_rate_per_hour / 3600.0,
                             max_recovery_s=config.max_recovery_s, batch_memory_bytes=config.batch_memory_bytes,
                             max_pending_batches=config.max_pending_batches,
                             max_full_every=MAX_FULL_EVERY, max_batch_steps=MAX_BATCH_STEPS)
        self.meter = CostMeter()
        self.policy = Policy(self.limits, full_every=config.full_every, batch_steps=config.batch_steps,
                             differentials=config.differentials)
        self._state_dir: str | None = None     # where CONTROLLER.json is kept (load_state)
        self._unsaved = False                    # a decision or probe since CONTROLLER.json was written
        self._save_lock = threading.Lock()       # one writer of CONTROLLER.json at a time

    # the settings in force and the decisions: the policy's, read (and some set) through here --------
    full_every: int = _of_policy("full_every", "The full-checkpoint interval in force.", writable=True)
    batch_steps: int = _of_policy("batch_steps", "The differential batch size in force.", writable=True)
    differentials_wanted: bool = _of_policy(
        "differentials_wanted", "Whether differentials are wanted (the session switches at a full checkpoint).",
        writable=True)
    auto_full: bool = _of_policy("auto_full", "Whether full_every is the controller's to choose.")
    auto_batch: bool = _of_policy("auto_batch", "Whether batch_steps is the controller's to choose.")
    auto_differentials: bool = _of_policy("auto_differentials", "Whether differentials are the controller's.")
    history: list[Decision] = _of_policy("history", "The decisions of this session, oldest first.")
    current: Evaluation | None = _of_policy("current", "The model's prediction for the settings in force.")
    probes: int = _of_policy("probes", "Probes that gave a sample in this session.")

    @property
    def differentials(self) -> bool:
        """Whether the next step records a differential (read by the session before each step):
        the setting in force (``differentials_wanted``), the other way round while a probe runs.
        Setting it sets ``differentials_wanted``."""
        return self.policy.differentials

    @differentials.setter
    def differentials(self, value: bool) -> None:
        self.policy.differentials_wanted = bool(value)

    @property
    def _windows(self) -> dict[str, Window]:
        # (The meter's windows, under the name tests have always reached them by.)
        return self.meter.windows

    # earlier sessions ---------------------------------------------------------
    def load_state(self, directory: str) -> None:
        """Start from the measurements that earlier sessions kept in ``directory`` (CONTROLLER.json),
        and keep this session's there from now on. A file that cannot be used is named in a
        warning and replaced at the next full checkpoint; the initial guesses are used meanwhile."""
        self._state_dir = directory
        try:
            settings = self.meter.load(directory)
        except UnusableState as exc:
            warnings.warn(f"lowdiff: {exc}; the controller starts from its initial guesses", RuntimeWarning,
                          stacklevel=2)
            return
        if settings is None:
            return
        with self._lock:
            self.policy.adopt(settings)
            # The settings in force are a decision already (logged, and changed only with hysteresis).
            first = self.policy.continue_from(self.meter.measured(self.policy.differentials_wanted),
                                              f"settings and measurements of earlier sessions ({CONTROLLER_NAME})")
            if first is None:
                return
            log.info("lowdiff controller: continuing with full_every %d, batch_steps %s of earlier sessions "
                     "(%s); predicted waste %.4f%%", first.full_every, first.batch_steps or "off",
                     CONTROLLER_NAME, 100 * first.predicted_waste)
            self._resolve_locked("measurements of earlier sessions")

    def save_state(self) -> None:
        """Write the measurements and settings to CONTROLLER.json (full-writer thread, after a
        commit). Advice only: a failure is logged, never raised into the checkpoint writer."""
        if self._state_dir is None:
            return
        with self._save_lock:   # (the newest snapshot is written last)
            with self._lock:
                settings = self.policy.settings()
                self._unsaved = False
            try:
                self.meter.save(self._state_dir, settings)
            except OSError as exc:
                log.warning("lowdiff controller: could not write %s in %s: %s", CONTROLLER_NAME, self._state_dir,
                            exc)

    # measurements -----------------------------------------------------------
    def resumed(self, load_s: float, replay_s: float, replayed: int) -> None:
        """recovery.resume, at its end: the full checkpoint took ``load_s`` to load and
        ``replayed`` records took ``replay_s`` to replay (see CostMeter.resumed)."""
        self.meter.resumed(load_s, replay_s, replayed)

    def step_finished(self, optimizer_step_s: float, recording: bool = True) -> None:
        """Training thread, right after the inner optimizer step; ``recording``: whether this
        step records a differential."""
        now = time.perf_counter()
        with self._lock:
            clean_s = self.meter.step_finished(now, optimizer_step_s, recording)
            probes = self.meter.count("record_ratio") if self.policy.auto_differentials else 0
            self._probe_sampled_locked(self.policy.step_finished(recording, clean_s, probes))

    def _probe_sampled_locked(self, ratio: float | None) -> None:
        """A probe ended with ``ratio`` (None: without a sample)."""
        if ratio is not None:
            self.meter.add("record_ratio", ratio)
            self._unsaved = True   # (written by the diff writer or the full writer, not on this thread)

    def _end_probe_locked(self) -> None:
        """End the probe in progress (its sample, if any, is measured)."""
        self._probe_sampled_locked(self.policy.end_probe())

    def step_recorded(self, record_s: float) -> None:
        """Training thread: what recording the step cost it (capture, compression, hand-over)."""
        self.meter.step_recorded(record_s)

    def full_taken(self, stall_s: float) -> None:
        """Training thread, when a full checkpoint's stall has ended."""
        with self._lock:
            self.meter.full_taken(stall_s, self.policy.differentials_wanted)
            self._probe_sampled_locked(self.policy.full_taken())

    def full_persisted(self, persist_s: float, nbytes: int) -> None:
        """Full-writer thread, when a full checkpoint of ``nbytes`` is committed."""
        with self._lock:
            self.meter.full_persisted(persist_s, nbytes)
            self._resolve_locked("full checkpoint persisted")
        self.save_state()

    def batch_written(self, steps: int, write_s: float, nbytes: int) -> None:
        """Diff-writer thread, when a batch of ``steps`` records (``nbytes``) is committed."""
        with self._lock:
            self.meter.batch_written(steps, write_s, nbytes)
            if self.policy.batch_written():
                self._resolve_locked("periodic")
            unsaved = self._unsaved
        if unsaved:   # a decision or a probe's sample is not lost to a SIGKILL before the next full
            self.save_state()

    def maybe_time_decode(self, encoded: list) -> None:
        """Diff-writer thread, with a record just encoded: now and then, time decoding it."""
        self.meter.maybe_time_decode(encoded)

    # the model's inputs ------------------------------------------------------
    def costs(self) -> Costs | None:
        """The measured costs (medians of recent samples), or None until each has been seen."""
        with self._lock:
            return self.meter.costs(self.policy.differentials_wanted)

    def differentials_measured(self) -> bool:
        """Whether steps that record differentials and their batch writes have been measured."""
        return self.meter.differentials_measured()

    # decisions --------------------------------------------------------------
    def _resolve_locked(self, why: str) -> None:
        """Let the policy decide from what the meter measured; log what it changed. The caller
        holds the lock."""
        measured = self.meter.measured(self.policy.differentials_wanted)
        change = self.policy.resolve(measured, why, time.perf_counter() - self._started)
        if change is None:
            return
        self._unsaved = True
        decision, replaced = change
        log.info("lowdiff controller: full_every %d -> %d, batch_steps %s -> %s (%s); predicted waste %.4f%% "
                 "(was %.4f%%), constraints broken before: %s; inputs: %s", replaced.full_every,
                 decision.full_every, replaced.batch_steps or "off", decision.batch_steps or "off", decision.reason,
                 100 * decision.predicted_waste, 100 * replaced.waste, ", ".join(replaced.violated) or "none",
                 _short(decision.costs))

    # reports ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Median and max of the recent samples, in milliseconds, and how many there were; and
        under "controller" the measured costs, the prediction for the settings in force and the
        decision history (all JSON-serialisable: ``python -m lowdiff tune --stats`` reads them)."""
        with self._lock:
            out = self.meter.stats()
            costs = self.meter.costs(self.policy.differentials_wanted)
            current = self.policy.current
            history = [d.as_dict() for d in self.policy.history]
            probes, ratio = self.policy.probes, self.meter.value("record_ratio")
        out["controller"] = {
            "auto_full": self.auto_full, "auto_batch": self.auto_batch,
            "auto_differentials": self.auto_differentials, "differentials": self.differentials_wanted,
            "failure_rate_per_hour": self.limits.failure_rate_per_s * 3600.0,
            "max_recovery_s": self.limits.max_recovery_s,
            "probes": probes, "record_ratio": ratio,
            "costs": dataclasses.asdict(costs) if costs is not None else None,
            "predicted": dataclasses.asdict(current) if current is not None else None,
            "history": history}
        return out

    def describe(self) -> dict:
        """The settings in force and the medians they were chosen from."""
        with self._lock:
            return {"full_every": self.full_every, "batch_steps": self.batch_steps,
                    "differentials": self.differentials_wanted, "auto_differentials": self.auto_differentials,
                    "auto_full": self.auto_full, "auto_batch": self.auto_batch,
                    "step_s": self.meter.value("step_s"), "stall_s": self.meter.value("stall_s"),
                    "persist_s": self.meter.value("persist_s"), "decisions": len(self.history)}


def _short(values: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) and math.isfinite(v) else f"{k}={v}"
                     for k, v in values.items())
