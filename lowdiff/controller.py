"""The controller: picks the full-checkpoint interval and the differential batch size.

With fixed settings it just reports them. With "auto" it uses costs measured while training runs:
  T  step time, S  training-thread stall of a full snapshot, P  background persist time of a full
  checkpoint, r  replay cost of one step at recovery (about one optimizer step), W  write time of a
  differential batch, and the failure rate lambda the user states.
Overhead per unit of training time is S/(F*T) for fulls plus lambda*(F*r/2) for the expected
replay after a failure; its minimum is at F* = sqrt(2*S / (T*lambda*r)). F never goes below
ceil(P/T), so a full checkpoint finishes persisting before the next one is due. The batch size
is the smallest B whose write keeps the writer below half busy: W(B) <= B*T/2; a smaller B loses
less on a crash (at most about two batches).

Thread safety: the training thread, the diff-writer thread and the full-writer thread all report
to one Controller; one lock guards every method. ``full_every`` and ``batch_steps`` are read as
plain attributes, without it: each is one int, replaced whole.
"""
from __future__ import annotations

import collections
import math
import statistics
import threading
import time

AUTO_INITIAL_FULL_EVERY = 50
AUTO_INITIAL_BATCH_STEPS = 8
MAX_BATCH_STEPS = 64
MAX_FULL_EVERY = 100_000
SAMPLES_KEPT = 1000


class _Mean:
    """Exponential moving average (None until the first sample)."""

    def __init__(self, weight: float = 0.2):
        self.weight = weight
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample


class Controller:
    """The measurements of one run and the settings chosen from them (see the module docstring)."""

    def __init__(self, config):
        self._lock = threading.Lock()
        self.auto_full = config.full_every == "auto"
        self.auto_batch = config.batch_steps == "auto"
        self.full_every = AUTO_INITIAL_FULL_EVERY if self.auto_full else config.full_every
        self.batch_steps = AUTO_INITIAL_BATCH_STEPS if self.auto_batch else config.batch_steps
        self.failure_rate_per_s = config.failure_rate_per_hour / 3600.0
        self.step_s = _Mean()
        self.optimizer_step_s = _Mean()
        self.stall_s = _Mean(0.5)
        self.persist_s = _Mean(0.5)
        self.batch_write_s_per_step = _Mean(0.5)
        self._last_step_end = None
        # Raw samples of the recent past, for stats(): the averages above weigh the latest most.
        self.samples = {name: collections.deque(maxlen=SAMPLES_KEPT)
                        for name in ("full_stall_s", "full_persist_s", "batch_write_s")}

    # measurements -----------------------------------------------------------
    def step_finished(self, optimizer_step_s: float) -> None:
        """Training thread, after each optimizer step."""
        now = time.perf_counter()
        with self._lock:
            if self._last_step_end is not None:
                self.step_s.add(now - self._last_step_end)
            self._last_step_end = now
            self.optimizer_step_s.add(optimizer_step_s)

    def full_taken(self, stall_s: float) -> None:
        """Training thread, when a full checkpoint's stall has ended."""
        with self._lock:
            self.stall_s.add(stall_s)
            self.samples["full_stall_s"].append(stall_s)
            self._last_step_end = None  # the stall is not part of a normal step

    def full_persisted(self, persist_s: float) -> None:
        """Full-writer thread, when a full checkpoint is committed."""
        with self._lock:
            self.persist_s.add(persist_s)
            self.samples["full_persist_s"].append(persist_s)
            self._update_locked()

    def batch_written(self, steps: int, write_s: float) -> None:
        """Diff-writer thread, when a batch of ``steps`` records is committed."""
        with self._lock:
            self.batch_write_s_per_step.add(write_s / max(steps, 1))
            self.samples["batch_write_s"].append(write_s)
            self._update_locked()

    # decisions --------------------------------------------------------------
    def _update_locked(self) -> None:
        """Choose ``full_every``/``batch_steps`` again. The caller holds the lock."""
        step_s = self.step_s.value
        if not step_s:
            return
        if self.auto_full and self.stall_s.value is not None:
            replay_s = max(self.optimizer_step_s.value or step_s * 0.1, 1e-6)
            best = math.sqrt(2 * max(self.stall_s.value, 1e-6) / (step_s * self.failure_rate_per_s * replay_s))
            floor = math.ceil((self.persist_s.value or 0.0) / step_s) + 1
            self.full_every = int(min(MAX_FULL_EVERY, max(best, floor, 1)))
        if self.auto_batch and self.batch_write_s_per_step.value is not None:
            per_batch_s = self.batch_write_s_per_step.value * self.batch_steps
            # W(B) ~= per_batch_s (dominated by fixed costs for small batches): need W <= B*T/2.
            needed = math.ceil(2 * per_batch_s / step_s)
            self.batch_steps = int(min(MAX_BATCH_STEPS, max(1, needed)))

    def stats(self) -> dict:
        """Median and max of the recent samples, in milliseconds, and how many there were."""
        with self._lock:
            samples = {name: list(values) for name, values in self.samples.items()}
        out: dict[str, float | None] = {}
        for name, values in samples.items():
            key = name.removesuffix("_s")
            out[f"{key}_count"] = len(values)
            out[f"{key}_median_ms"] = statistics.median(values) * 1e3 if values else None
            out[f"{key}_max_ms"] = max(values) * 1e3 if values else None
        return out

    def describe(self) -> dict:
        """The settings in force and the averages they were chosen from."""
        with self._lock:
            return {"full_every": self.full_every, "batch_steps": self.batch_steps,
                    "auto_full": self.auto_full, "auto_batch": self.auto_batch,
                    "step_s": self.step_s.value, "stall_s": self.stall_s.value, "persist_s": self.persist_s.value}
