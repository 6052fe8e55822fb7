"""The controller: measures what checkpointing costs in this process and picks the full-checkpoint
interval (``full_every``), the differential batch size (``batch_steps``) and, only with
``differentials="auto"`` (the user's consent to give up per-step durability), whether differentials
are recorded at all — whatever minimises the expected wasted time under the failure rate the user
states (lowdiff.control.costmodel; derivation in docs/controller.md). With fixed settings it measures and
reports, and changes nothing.

Measurements outlive the process: they are written to CONTROLLER.json beside the manifest after
each full checkpoint, after each applied decision and after each probe (at the next batch write)
(lowdiff.control.controlstate) and read back when a session opens the directory, and
``recovery.resume`` reports what a restart really cost (``resumed``): load, replay per record and
the restart itself (process start to the end of resume, minus load and replay).

Measurements are medians of recent samples (robust to the odd slow write or GC pause). Decisions
are re-solved after every full checkpoint persists and every ``RESOLVE_EVERY_BATCHES`` batches, and
applied only when the new optimum is predicted to waste clearly less than the settings in force
(hysteresis), or when those settings break a constraint. Until a few full checkpoints' costs are
measured (the learning phase), each decision moves a setting by at most a factor 2 and waits for a
new one; "auto" keeps differentials until a few probes are in. Each applied decision is logged
(logger "lowdiff", INFO) with its inputs and kept in ``history``.

Thread safety: the training thread, the diff-writer thread and the full-writer thread all report
to one Controller; one lock guards every method. ``full_every`` and ``batch_steps`` are read as
plain attributes, without it: each is one int, replaced whole, and any value is safe to act on
(a batch closes at whatever size it has; a full checkpoint is due when the interval in force says).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import statistics
import threading
import time
import warnings
from typing import Any

from lowdiff.control.controlstate import CONTROLLER_NAME, UnusableState, read_state, write_state
from lowdiff.control.costmodel import Costs, Evaluation, Limits, evaluate, replay_estimate, solve
from lowdiff.format.records import decode_record
from lowdiff.step.apply import replay_workers

log = logging.getLogger("lowdiff")

# The guess in force before anything is measured (docs/controller.md, "Learning phase"): the
# shortest interval the probe can run in, and one record per write — every cost is measured within
# the first steps, the least memory is held and the least work is lost while the guess is in force.
AUTO_INITIAL_FULL_EVERY = 16
AUTO_INITIAL_BATCH_STEPS = 1
MAX_BATCH_STEPS = 256
MAX_FULL_EVERY = 100_000
SAMPLES_KEPT = 1000
WINDOW = 63                   # samples behind each median
RESOLVE_EVERY_BATCHES = 8
DECODE_SAMPLE_EVERY = 64      # records between two timed decodes (the first record is always timed)
HYSTERESIS = 0.05             # change only for a predicted waste at least this much (relative) lower ...
HYSTERESIS_ABS = 1e-4         # ... and by at least this much of the wall-clock time
# The probe (differentials="auto" only): what recording costs is what steps with differentials
# take longer than steps without, timed side by side now and then (see Controller._plan_probe_locked).
PROBE_STEPS = 4               # steps of the other kind per probe
PROBE_MIN_FULL_EVERY = 4 * PROBE_STEPS   # shorter intervals are not probed
PROBE_EVERY_FULLS = 8         # full checkpoints between two probes, once PROBE_WARMUP probes are in
PROBE_WARMUP = 3
DECIDE_WITHOUT_PROBE_FULLS = 3   # "auto" waits for its first probe this many full checkpoints at most
# The learning phase: until the cost of LEARNING_FULL_COSTS full checkpoints has been measured
# (full_cost_s, kept in CONTROLLER.json), a decision moves full_every and batch_steps by at most a
# factor LEARNING_FACTOR, and only after a new such sample (one decision per measured full
# checkpoint), unless the settings in force break a constraint that only a larger move meets.
# "auto" keeps differentials on until PROBE_WARMUP probes are in (and full_every >= the probe's
# minimum meanwhile, so that they can run): one probe is no ground to give up per-step durability.
LEARNING_FULL_COSTS = 4
LEARNING_FACTOR = 2


# What is measured (each a window of samples). Step intervals are kept apart by whether the step
# recorded a differential and whether a full checkpoint was in flight ("busy").
# A step whose interval holds a full checkpoint's stall is measured apart too ("full_step_s"), so
# that a full checkpoint every step or two is charged what it costs. "full_cost_s": per full
# checkpoint, what that step and the steps overlapping its persist took longer than the clean steps
# just before it. "record_ratio": a probe's median step with differentials over its median step without.
MEASURED = ("step_s", "busy_step_s", "bare_step_s", "bare_busy_step_s", "full_step_s", "bare_full_step_s",
            "full_cost_s", "optimizer_step_s", "record_s", "record_ratio", "stall_s", "persist_s", "full_bytes",
            "batch_write_s", "batch_bytes", "batch_steps", "decode_s", "replay_record_s", "replay_records",
            "replay_total_s", "load_s", "restart_s")
REPLAY_MIN_RECORDS = 8        # a resume's replay per record is trusted alone from this many records on


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22: start time after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started_s)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class _Window:
    """The median of the last ``WINDOW`` samples (None before the first)."""

    def __init__(self):
        self.samples: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def add(self, sample: float) -> None:
        self.samples.append(sample)

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


@dataclasses.dataclass
class _Probe:
    """A probe in progress: ``recording`` is what its steps do (the opposite of the setting in
    force); ``baseline`` the clean step intervals of the other kind just before it."""

    recording: bool
    baseline: list[float]
    fulls_at_start: int
    samples: list[float] = dataclasses.field(default_factory=list)
    steps: int = 0


@dataclasses.dataclass(frozen=True)
class Decision:
    """One applied choice: the settings, what the model predicted for them and for the settings
    they replaced, and the measured costs it was made from."""

    steps_seen: int
    time_s: float             # since the controller started
    full_every: int
    batch_steps: int | None   # None: differentials off (full checkpoints only)
    predicted_waste: float
    previous_waste: float | None
    reason: str
    costs: dict

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class Controller:
    """The measurements of one run and the settings chosen from them (see the module docstring)."""

    def __init__(self, config):
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self.auto_full = config.full_every == "auto"
        self.auto_batch = config.batch_steps == "auto"
        self.auto_differentials = config.differentials == "auto"
        self.full_every = AUTO_INITIAL_FULL_EVERY if self.auto_full else config.full_every
        self.batch_steps = AUTO_INITIAL_BATCH_STEPS if self.auto_batch else config.batch_steps
        # Whether differentials are wanted (the session switches at a full checkpoint). "auto"
        # starts with them: their costs must be measured before they can be judged.
        self.differentials_wanted: bool = config.differentials is not False
        self.limits = Limits(failure_rate_per_s=config.failure_rate_per_hour / 3600.0,
                             max_recovery_s=config.max_recovery_s, batch_memory_bytes=config.batch_memory_bytes,
                             max_pending_batches=config.max_pending_batches,
                             max_full_every=MAX_FULL_EVERY, max_batch_steps=MAX_BATCH_STEPS)
        self._probe: _Probe | None = None
        self.probes = 0                          # probes that gave a sample
        self._fulls_since_probe = 0
        self._fulls_seen = 0
        self._steps_since_full = 0
        # Clean step intervals of the current full interval, newest last: (recording, seconds).
        self._interval: collections.deque[tuple[bool, float]] = collections.deque(maxlen=4 * PROBE_STEPS)
        self._after_full = False                 # the next step interval holds a full checkpoint's stall
        # The full checkpoint being charged: (clean step before it, extra seconds so far), or None.
        self._full_charge: list[float] | None = None
        self.history: list[Decision] = []
        self.current: Evaluation | None = None   # the model's prediction for the settings in force
        self._windows = {name: _Window() for name in MEASURED}
        # A full checkpoint costs training more than its stall: the steps that run while it is
        # copied and written share the CPU and memory bandwidth with it. Steps that end while one
        # is in flight are measured apart ("busy_step_s"), and the difference is charged to it.
        self._persist_in_flight = False
        self._state_dir: str | None = None     # where CONTROLLER.json is kept (load_state)
        self._last_step_end: float | None = None
        self._steps_seen = 0
        self._records_seen = 0
        self._batches_since_solve = 0
        self._full_costs_decided = -1            # full_cost_s samples behind the last decision
        self._unsaved = False                    # a decision or probe since CONTROLLER.json was written
        self._save_lock = threading.Lock()       # one writer of CONTROLLER.json at a time
        # Raw samples of the recent past, for stats().
        self.samples = {name: collections.deque(maxlen=SAMPLES_KEPT)
                        for name in ("full_stall_s", "full_persist_s", "batch_write_s")}

    @property
    def differentials(self) -> bool:
        """Whether the next step records a differential (read by the session before each step):
        the setting in force (``differentials_wanted``), the other way round while a probe runs.
        Setting it sets ``differentials_wanted``."""
        probe = self._probe
        return probe.recording if probe is not None else self.differentials_wanted

    @differentials.setter
    def differentials(self, value: bool) -> None:
        self.differentials_wanted = bool(value)

    # earlier sessions ---------------------------------------------------------
    def load_state(self, directory: str) -> None:
        """Start from the measurements that earlier sessions kept in ``directory`` (CONTROLLER.json),
        and keep this session's there from now on. A file that cannot be used is named in a
        warning and replaced at the next full checkpoint; the initial guesses are used meanwhile."""
        self._state_dir = directory
        try:
            found = read_state(directory)
        except UnusableState as exc:
            warnings.warn(f"lowdiff: {exc}; the controller starts from its initial guesses", RuntimeWarning,
                          stacklevel=2)
            return
        if found is None:
            return
        samples, settings = found
        with self._lock:
            for name, values in samples.items():
                if name in self._windows:
                    self._windows[name].samples.extend(values[-WINDOW:])
            self._adopt_settings_locked(settings)
            costs = self._costs_locked()
            if not (self.auto_full or self.auto_batch or self.auto_differentials) or costs is None or \
                    (self.differentials_wanted and not self._differentials_measured_locked()):
                return
            # The settings in force are a decision already (logged, and changed only with hysteresis).
            self.current = self._evaluate_in_force_locked(costs)
            self.history.append(Decision(0, 0.0, self.full_every, self.current.batch_steps, self.current.waste, None,
                                         f"settings and measurements of earlier sessions ({CONTROLLER_NAME})",
                                         dataclasses.asdict(costs)))
            log.info("lowdiff controller: continuing with full_every %d, batch_steps %s of earlier sessions "
                     "(%s); predicted waste %.4f%%", self.full_every, self.current.batch_steps or "off",
                     CONTROLLER_NAME, 100 * self.current.waste)
            self._resolve_locked("measurements of earlier sessions")

    def _adopt_settings_locked(self, settings: dict) -> None:
        """Continue with the auto settings an earlier session chose (ignored unless sensible)."""
        def positive_int(value, cap):
            return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= cap

        if self.auto_full and positive_int(settings.get("full_every"), MAX_FULL_EVERY):
            self.full_every = settings["full_every"]
        if self.auto_batch and positive_int(settings.get("batch_steps"), MAX_BATCH_STEPS):
            self.batch_steps = settings["batch_steps"]
        if self.auto_differentials and isinstance(settings.get("differentials"), bool):
            self.differentials_wanted = settings["differentials"]

    def save_state(self) -> None:
        """Write the measurements and settings to CONTROLLER.json (full-writer thread, after a
        commit). Advice only: a failure is logged, never raised into the checkpoint writer."""
        if self._state_dir is None:
            return
        with self._save_lock:   # (the newest snapshot is written last)
            with self._lock:
                samples = {name: list(window.samples) for name, window in self._windows.items() if window.samples}
                settings = {"full_every": self.full_every, "batch_steps": self.batch_steps,
                            "differentials": self.differentials_wanted}
                self._unsaved = False
            try:
                write_state(self._state_dir, samples, settings)
            except OSError as exc:
                log.warning("lowdiff controller: could not write %s in %s: %s", CONTROLLER_NAME, self._state_dir,
                            exc)

    # measurements -----------------------------------------------------------
    def resumed(self, load_s: float, replay_s: float, replayed: int) -> None:
        """recovery.resume, at its end: the full checkpoint took ``load_s`` to load and
        ``replayed`` records took ``replay_s`` to replay. What this process spent before being
        ready to train, besides those two, is its restart time (interpreter, imports, model build,
        wrap, planning the resume)."""
        age_s = process_age_s()
        with self._lock:
            if load_s > 0:
                self._windows["load_s"].add(load_s)
            if replayed > 0:
                self._windows["replay_record_s"].add(replay_s / replayed)
                self._windows["replay_records"].add(float(replayed))
                self._windows["replay_total_s"].add(replay_s)
            if age_s is not None:
                self._windows["restart_s"].add(max(0.0, age_s - load_s - replay_s))

    def step_finished(self, optimizer_step_s: float, recording: bool = True) -> None:
        """Training thread, right after the inner optimizer step; ``recording``: whether this
        step records a differential."""
        now = time.perf_counter()
        with self._lock:
            clean_s = None
            if self._last_step_end is not None:
                interval_s = now - self._last_step_end
                busy = self._persist_in_flight
                if self._after_full:
                    name = "full_step_s" if recording else "bare_full_step_s"
                else:
                    name = ("busy_step_s" if busy else "step_s") if recording else \
                        ("bare_busy_step_s" if busy else "bare_step_s")
                    if not busy:
                        clean_s = interval_s
                self._windows[name].add(interval_s)
                charge = self._full_charge
                if charge is not None:
                    if clean_s is None:
                        charge[1] += interval_s - charge[0]
                    else:
                        self._charge_full_locked()
            self._after_full = False
            self._last_step_end = now
            self._windows["optimizer_step_s"].add(optimizer_step_s)
            self._steps_seen += 1
            self._steps_since_full += 1
            if clean_s is not None:
                self._interval.append((recording, clean_s))
            if self.auto_differentials:
                self._plan_probe_locked(recording, clean_s)

    def _plan_probe_locked(self, recording: bool, clean_s: float | None) -> None:
        """After a step: run, end or start a probe, which sets what the next step does.

        With differentials on, the PROBE_STEPS steps before a full checkpoint that is due anyway
        record nothing (the batch before them is sealed; the full checkpoint restarts the chain),
        and are compared with the clean steps just before them. The first probe does not wait for
        a full checkpoint: it runs once PROBE_STEPS clean steps are timed, and the step after it
        takes an extra full checkpoint. With differentials off, recording starts at a full
        checkpoint that is due anyway and stops once PROBE_STEPS clean steps with it are timed,
        compared with the clean steps without it before that full checkpoint. Each probe gives one
        sample of ``record_ratio``. Its price: the few steps of an "on" probe are durable only
        with the full checkpoint after them. Training thread only (it alone sets ``_probe``)."""
        probe, place = self._probe, self._steps_since_full + 1    # the next step's place in the interval
        if probe is not None:
            if recording == probe.recording:
                probe.steps += 1
                if clean_s is not None:
                    probe.samples.append(clean_s)
            ended = len(probe.samples) >= PROBE_STEPS or probe.steps >= 4 * PROBE_STEPS
            if not probe.recording:
                ended = ended or probe.steps >= PROBE_STEPS or place >= self.full_every
            elif place >= self.full_every and self._fulls_seen > probe.fulls_at_start:
                ended = True   # (not before the full checkpoint that starts its differentials)
            if ended:
                self._end_probe_locked()
            return
        due = len(self._windows["record_ratio"].samples) < PROBE_WARMUP or \
            self._fulls_since_probe >= PROBE_EVERY_FULLS
        if not due or self.full_every < PROBE_MIN_FULL_EVERY:
            return
        if self.differentials_wanted:
            baseline = [s for rec, s in self._interval if rec][-PROBE_STEPS:]
            first = not self._windows["record_ratio"].samples
            if len(baseline) >= 2 and (place == self.full_every - PROBE_STEPS or
                                       (first and len(baseline) >= PROBE_STEPS and
                                        place < self.full_every - PROBE_STEPS)):
                self._probe = _Probe(False, baseline, self._fulls_seen)
        elif place == self.full_every:
            baseline = [s for rec, s in self._interval if not rec][-PROBE_STEPS:]
            if len(baseline) >= 2:
                self._probe = _Probe(True, baseline, self._fulls_seen)

    def _charge_full_locked(self) -> None:
        """The full checkpoint being charged has no more slow steps: one sample of its cost."""
        charge, self._full_charge = self._full_charge, None
        if charge is not None:
            self._windows["full_cost_s"].add(max(0.0, charge[1]))

    def _end_probe_locked(self) -> None:
        probe, self._probe = self._probe, None
        if probe is None:
            return
        self._fulls_since_probe = 0
        if len(probe.samples) < 2 or len(probe.baseline) < 2:
            return
        with_s, without_s = (probe.samples, probe.baseline) if probe.recording else (probe.baseline, probe.samples)
        self._windows["record_ratio"].add(statistics.median(with_s) / max(statistics.median(without_s), 1e-9))
        self.probes += 1
        self._unsaved = True   # (written by the diff writer or the full writer, not on this thread)

    def step_recorded(self, record_s: float) -> None:
        """Training thread: what recording the step cost it (capture, compression, hand-over)."""
        with self._lock:
            self._windows["record_s"].add(record_s)

    def full_taken(self, stall_s: float) -> None:
        """Training thread, when a full checkpoint's stall has ended."""
        with self._lock:
            self._windows["stall_s"].add(stall_s)
            self.samples["full_stall_s"].append(stall_s)
            self._after_full = True     # the next step interval holds the stall (see _full_cost_locked)
            self._charge_full_locked()  # the previous one, if no clean step came between
            kind = self.differentials_wanted
            recent = [s for rec, s in self._interval if rec == kind] or \
                list(self._windows["step_s" if kind else "bare_step_s"].samples)[-PROBE_STEPS:]
            if recent:
                self._full_charge = [statistics.median(recent[-2 * PROBE_STEPS:]), 0.0]
            self._persist_in_flight = True
            self._steps_since_full = 0
            self._fulls_seen += 1
            self._fulls_since_probe += 1
            self._interval.clear()
            if self._probe is not None and not self._probe.recording:
                self._end_probe_locked()   # full_every shrank under it: differentials restart at the next full

    def full_persisted(self, persist_s: float, nbytes: int) -> None:
        """Full-writer thread, when a full checkpoint of ``nbytes`` is committed."""
        with self._lock:
            self._persist_in_flight = False
            self._windows["persist_s"].add(persist_s)
            self._windows["full_bytes"].add(float(nbytes))
            self.samples["full_persist_s"].append(persist_s)
            self._resolve_locked("full checkpoint persisted")
        self.save_state()

    def batch_written(self, steps: int, write_s: float, nbytes: int) -> None:
        """Diff-writer thread, when a batch of ``steps`` records (``nbytes``) is committed."""
        with self._lock:
            self._windows["batch_write_s"].add(write_s)
            self._windows["batch_bytes"].add(float(nbytes))
            self._windows["batch_steps"].add(float(max(steps, 1)))
            self.samples["batch_write_s"].append(write_s)
            self._batches_since_solve += 1
            if self._batches_since_solve >= RESOLVE_EVERY_BATCHES or not self.history:
                self._resolve_locked("periodic")
            unsaved = self._unsaved
        if unsaved:   # a decision or a probe's sample is not lost to a SIGKILL before the next full
            self.save_state()

    def maybe_time_decode(self, encoded: list) -> None:
        """Diff-writer thread, with a record just encoded: now and then, time decoding it — the
        decode half of replaying it (the other half, the optimizer step, is timed in training)."""
        with self._lock:
            self._records_seen += 1
            if (self._records_seen - 1) % DECODE_SAMPLE_EVERY:
                return
        data = b"".join(encoded)
        started = time.perf_counter()
        decode_record(data, "<timed sample>", 0)
        elapsed = time.perf_counter() - started
        with self._lock:
            self._windows["decode_s"].add(elapsed)

    # the model's inputs ------------------------------------------------------
    def costs(self) -> Costs | None:
        """The measured costs (medians of recent samples), or None until each has been seen."""
        with self._lock:
            return self._costs_locked()

    def differentials_measured(self) -> bool:
        """Whether steps that record differentials and their batch writes have been measured."""
        with self._lock:
            return self._differentials_measured_locked()

    def _differentials_measured_locked(self) -> bool:
        return all(self._windows[name].value is not None for name in ("step_s", "optimizer_step_s", "batch_write_s"))

    def _costs_locked(self) -> Costs | None:
        """The model's inputs. Needs a full checkpoint persisted and steps timed with or without
        differentials; the differentials' own costs are 0 until measured (see
        ``differentials_measured``)."""
        v = {name: window.value for name, window in self._windows.items()}
        if v["stall_s"] is None or v["persist_s"] is None or (v["step_s"] is None and v["bare_step_s"] is None):
            return None
        in_thread_s = v["record_s"] or 0.0
        ratio = v["record_ratio"]
        fresh = "step_s" if self.differentials_wanted else "bare_step_s"   # the kind timed all the time
        if ratio is not None and v[fresh] is not None:
            # Probed: steps with differentials take ``ratio`` times as long as steps without,
            # timed side by side (so a change of the machine's load falls on both alike). Applied
            # to the kind of step timed now, as the other kind's samples may be old.
            with_s = v[fresh] if self.differentials_wanted else v[fresh] * ratio
            without_s = with_s / ratio
            record_s = max(in_thread_s, with_s - without_s)
            step_s = max(with_s - record_s, 1e-6)
        elif v["bare_step_s"] is not None:
            # Steps without differentials measured: recording costs what steps with them take
            # longer (which includes the writer threads' competition for the CPU), never less
            # than the training thread's own share of it.
            step_s = v["bare_step_s"]
            record_s = max(in_thread_s, v["step_s"] - step_s) if v["step_s"] is not None else in_thread_s
        else:
            # The interval between step ends holds the recording too; Costs.step_s excludes it.
            assert v["step_s"] is not None
            step_s, record_s = max(v["step_s"] - in_thread_s, 1e-6), in_thread_s
        # Every write's bytes/second is a lower bound on the device's bandwidth (its time also
        # holds fixed costs); the best of them is tight once some write is large. Erring low
        # over-charges bytes, the safe side.
        batch_writes = list(zip(self._windows["batch_write_s"].samples, self._windows["batch_bytes"].samples))
        writes = batch_writes + list(zip(self._windows["persist_s"].samples, self._windows["full_bytes"].samples))
        bandwidth = max(max(b / max(s, 1e-9) for s, b in writes), 1.0)
        diff_bytes_per_step = fixed_s = replay_s = 0.0
        if batch_writes and v["batch_steps"]:
            diff_bytes_per_step = v["batch_bytes"] / v["batch_steps"]
            fixed_s = statistics.median(max(0.0, s - b / bandwidth) for s, b in batch_writes)
        replay_fit = self._replay_fit_locked()
        if replay_fit is not None:
            replay_fixed_s, replay_s = replay_fit     # what resumes of this directory really took
        elif v["optimizer_step_s"] is not None:
            # Reading assumes the read bandwidth equals the write bandwidth (docs/controller.md).
            # Copying a record into the gradients is not timed in training (the training thread's
            # recording time holds TopK's selection, which replay does not redo): left out.
            replay_s = replay_estimate(v["optimizer_step_s"], 0.0, diff_bytes_per_step / bandwidth,
                                       v["decode_s"] or 0.0, replay_workers())
        load_s = v["load_s"] if v["load_s"] is not None else v["full_bytes"] / bandwidth
        if replay_fit is not None:
            load_s += replay_fixed_s                  # a resume's replay costs this even for one record
        return Costs(step_s=step_s, record_s=record_s, stall_s=self._full_cost_locked(), persist_s=v["persist_s"],
                     full_bytes=v["full_bytes"], batch_fixed_s=fixed_s, diff_bytes_per_step=diff_bytes_per_step,
                     write_bytes_per_s=bandwidth, replay_s=replay_s, load_s=load_s, restart_s=v["restart_s"] or 0.0)

    def _replay_fit_locked(self) -> tuple[float, float] | None:
        """(fixed seconds per resume, seconds per record) of replay, from what resumes measured:
        total = fixed + per_record * records, fitted by least squares once resumes of different
        lengths were seen (a resume of two records spends most of its replay time setting up: its
        time per record is no measure of a long chain's); from one length alone, only if it is at
        least REPLAY_MIN_RECORDS records. None: not measured yet."""
        records = list(self._windows["replay_records"].samples)
        totals = list(self._windows["replay_total_s"].samples)
        if not records or len(records) != len(totals):
            return None
        if len(set(records)) >= 2:
            mean_n, mean_t = statistics.fmean(records), statistics.fmean(totals)
            var_n = sum((n - mean_n) ** 2 for n in records)
            per_record = sum((n - mean_n) * (t - mean_t) for n, t in zip(records, totals)) / var_n
            fixed = mean_t - per_record * mean_n
            if per_record > 0 and fixed >= 0:
                return fixed, per_record
        long_ones = [t / n for n, t in zip(records, totals) if n >= REPLAY_MIN_RECORDS]
        if long_ones:
            return 0.0, statistics.median(long_ones)
        return None

    def _full_cost_locked(self) -> float:
        """What one full checkpoint costs the training thread: what the step whose interval holds
        its stall took longer than a clean step (the stall, and the persist's competition during
        that step), plus what the further steps overlapping the persist took longer than clean ones
        (about (persist - busy step) / busy step of them); never less than the stall. Compared within
        the kind of step in force (with or without differentials), or else the other."""
        stall_s, persist_s = self._windows["stall_s"].value or 0.0, self._windows["persist_s"].value or 0.0
        charged_s = self._windows["full_cost_s"].value
        if charged_s is not None:
            return max(stall_s, charged_s)
        kinds = [("full_step_s", "busy_step_s", "step_s"), ("bare_full_step_s", "bare_busy_step_s", "bare_step_s")]
        if not self.differentials_wanted:
            kinds.reverse()
        for full, busy, clean in kinds:
            full_s, busy_s, clean_s = (self._windows[name].value for name in (full, busy, clean))
            if clean_s is None or (full_s is None and busy_s is None):
                continue
            cost_s = max(stall_s, full_s - clean_s) if full_s is not None else stall_s
            if busy_s is not None:
                overlapped_s = persist_s - (busy_s if full_s is not None else 0.0)
                cost_s += max(0.0, busy_s - clean_s) * max(0.0, overlapped_s) / busy_s
            return cost_s
        return stall_s

    # decisions --------------------------------------------------------------
    def _evaluate_in_force_locked(self, costs: Costs) -> Evaluation:
        return evaluate(costs, self.limits, self.full_every, self.batch_steps if self.differentials_wanted else None)

    def _resolve_locked(self, why: str) -> None:
        """Solve the model again; apply its answer if it beats the settings in force by the
        hysteresis margin, or if those break a constraint. The caller holds the lock."""
        self._batches_since_solve = 0
        costs = self._costs_locked()
        if costs is None:
            return
        measured = self._differentials_measured_locked()
        if self.differentials_wanted and not measured:
            return   # the costs of what is in force are not known yet
        self.current = self._evaluate_in_force_locked(costs)
        if not (self.auto_full or self.auto_batch or self.auto_differentials):
            return
        if self.auto_differentials and self.differentials_wanted and not self.history and \
                not self._windows["record_ratio"].samples and self.full_every >= PROBE_MIN_FULL_EVERY and \
                self._fulls_seen < DECIDE_WITHOUT_PROBE_FULLS:
            return   # the first probe is a few steps away: until it, recording looks cheaper than it is
        full_costs = len(self._windows["full_cost_s"].samples)
        learning = full_costs < LEARNING_FULL_COSTS
        if learning and self.history and full_costs <= self._full_costs_decided and not self.current.violated:
            return   # learning: one decision per measured full checkpoint
        # Differentials are judged only once measured; without consent ("auto") they stay as set,
        # and with it they stay on until the probe has sampled what they cost a few times.
        probing = self.auto_differentials and self.differentials_wanted and \
            len(self._windows["record_ratio"].samples) < PROBE_WARMUP and \
            (self.auto_full or self.full_every >= PROBE_MIN_FULL_EVERY) and \
            self._fulls_seen < PROBE_WARMUP + DECIDE_WITHOUT_PROBE_FULLS
        choice: bool | str = "auto" if self.auto_differentials and measured and not probing \
            else self.differentials_wanted
        best = solve(costs, self.limits, differentials=choice, full_every=None if self.auto_full else self.full_every,
                     batch_steps=None if self.auto_batch else self.batch_steps)
        optimum = best
        if learning or probing:
            best = self._limited_locked(costs, best, learning, probing)
        decide = choose(self.current, best, first=not self.history)
        if decide is None:
            return
        reason = f"{why}: {decide}"
        if best is not optimum:
            probes = len(self._windows["record_ratio"].samples)
            reason += (f" (learning, {full_costs} full checkpoint(s) measured, {probes} probe(s): limited from "
                       f"the optimum {optimum.full_every}/{optimum.batch_steps or 'off'})")
        self._full_costs_decided = full_costs
        self._unsaved = True
        self.history.append(Decision(self._steps_seen, time.perf_counter() - self._started, best.full_every,
                                     best.batch_steps, best.waste, self.current.waste, reason,
                                     dataclasses.asdict(costs)))
        log.info("lowdiff controller: full_every %d -> %d, batch_steps %s -> %s (%s); predicted waste %.4f%% "
                 "(was %.4f%%), constraints broken before: %s; inputs: %s", self.full_every, best.full_every,
                 self.current.batch_steps or "off", best.batch_steps or "off", reason, 100 * best.waste,
                 100 * self.current.waste, ", ".join(self.current.violated) or "none",
                 _short(dataclasses.asdict(costs)))
        self.full_every = best.full_every
        self.differentials_wanted = best.batch_steps is not None
        if best.batch_steps is not None:
            self.batch_steps = best.batch_steps   # kept while off: the size to use if they return
        self.current = best

    def _limited_locked(self, costs: Costs, best: Evaluation, learning: bool, probing: bool) -> Evaluation:
        """``best`` moved no further from the settings in force than the learning phase allows:
        learning, full_every and batch_steps within a factor LEARNING_FACTOR of those in force;
        probing, full_every at least the probe's minimum. A move the limit would leave breaking a
        constraint that ``best`` meets is not limited: constraints rest on sizes and write times,
        not on the few samples of a full checkpoint's cost."""
        full_every, batch_steps = best.full_every, best.batch_steps
        if self.auto_full:
            if learning:
                full_every = min(max(full_every, -(-self.full_every // LEARNING_FACTOR)),
                                 self.full_every * LEARNING_FACTOR)
            if probing:
                full_every = max(full_every, PROBE_MIN_FULL_EVERY)
        if learning and self.auto_batch and batch_steps is not None and self.differentials_wanted:
            batch_steps = min(max(batch_steps, -(-self.batch_steps // LEARNING_FACTOR)),
                              self.batch_steps * LEARNING_FACTOR)
        if (full_every, batch_steps) == (best.full_every, best.batch_steps):
            return best
        limited = evaluate(costs, self.limits, full_every, batch_steps)
        return best if len(limited.violated) > len(best.violated) else limited

    # reports ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Median and max of the recent samples, in milliseconds, and how many there were; and
        under "controller" the measured costs, the prediction for the settings in force and the
        decision history (all JSON-serialisable: ``python -m lowdiff tune --stats`` reads them)."""
        with self._lock:
            samples = {name: list(values) for name, values in self.samples.items()}
            costs = self._costs_locked()
            current = self.current
            history = [d.as_dict() for d in self.history]
            probes, ratio = self.probes, self._windows["record_ratio"].value
        out: dict[str, Any] = {}
        for name, values in samples.items():
            key = name.removesuffix("_s")
            out[f"{key}_count"] = len(values)
            out[f"{key}_median_ms"] = statistics.median(values) * 1e3 if values else None
            out[f"{key}_max_ms"] = max(values) * 1e3 if values else None
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
                    "step_s": self._windows["step_s"].value, "stall_s": self._windows["stall_s"].value,
                    "persist_s": self._windows["persist_s"].value, "decisions": len(self.history)}


def choose(current: Evaluation, best: Evaluation, *, first: bool = False) -> str | None:
    """Why to switch from ``current`` to ``best`` (None: keep ``current``). The first decision and
    a setting that breaks a constraint the new one meets switch at once; otherwise the predicted
    gain must clear both hysteresis margins, so noise in the measurements does not flip settings."""
    if first:
        return "first decision"
    if (best.full_every, best.batch_steps) == (current.full_every, current.batch_steps):
        return None
    if current.violated and len(best.violated) < len(current.violated):
        return f"settings in force break {', '.join(current.violated)}"
    gain = current.waste - best.waste
    if gain > HYSTERESIS * current.waste and gain > HYSTERESIS_ABS:
        return f"predicted waste {100 * gain:.4f}% of the time lower"
    return None


def _short(values: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) and math.isfinite(v) else f"{k}={v}"
                     for k, v in values.items())
