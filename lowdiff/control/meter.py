"""The cost meter: what checkpointing costs in this process, measured from the reports of the
training thread and the two writer threads — windows of recent samples (step, record, full
checkpoint, batch write, decode, replay, restart), the model's inputs (``Costs``) derived from
their medians, the samples kept in CONTROLLER.json between sessions, and the raw timings of
``stats()``.

Thread-safe: one lock guards every window. A step's end is timed by the caller (the controller,
before it takes its own lock) and passed in, so a step's interval holds no wait for a lock.
Measurements are medians of recent samples (robust to the odd slow write or GC pause).
"""
from __future__ import annotations

import collections
import os
import statistics
import threading
import time
from typing import Any

from lowdiff.control.controlstate import read_state, write_state
from lowdiff.control.costmodel import Costs, replay_estimate
from lowdiff.control.policy import PROBE_STEPS, Measured
from lowdiff.format.records import decode_record
from lowdiff.step.apply import replay_workers

SAMPLES_KEPT = 1000
WINDOW = 63                   # samples behind each median
DECODE_SAMPLE_EVERY = 64      # records between two timed decodes (the first record is always timed)
REPLAY_MIN_RECORDS = 8        # a resume's replay per record is trusted alone from this many records on

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
RAW = ("full_stall_s", "full_persist_s", "batch_write_s")   # raw samples of the recent past, for stats()


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc/self/stat), None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")   # field 22: start time after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started_s)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class Window:
    """The median of the last ``WINDOW`` samples (None before the first)."""

    def __init__(self):
        self.samples: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def add(self, sample: float) -> None:
        self.samples.append(sample)

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def measured_costs(directory: str) -> tuple[Costs, dict]:
    """(the costs, the settings in force) that the runs of ``directory`` measured and kept in its
    CONTROLLER.json — every run keeps them, with fixed settings as with "auto" — derived as the
    controller derives them. Raises ValueError naming the file and what is missing."""
    meter = CostMeter()
    settings = meter.load(directory)
    if settings is None:
        raise ValueError(f"{os.path.join(directory, 'CONTROLLER.json')}: not found (a run writes it with its "
                         f"first full checkpoint)")
    costs = meter.costs(bool(settings.get("differentials", True)))
    if costs is None:
        raise ValueError(f"{os.path.join(directory, 'CONTROLLER.json')}: the runs measured too little to derive "
                         f"costs (a full checkpoint persisted and steps timed are needed): train longer")
    return costs, settings


class CostMeter:
    """The measurements of one run (see the module docstring). ``windows`` maps each name of
    ``MEASURED`` to its ``Window``; ``samples`` each name of ``RAW`` to its recent raw samples."""

    def __init__(self):
        self._lock = threading.Lock()
        self.windows = {name: Window() for name in MEASURED}
        self.samples: dict[str, collections.deque[float]] = {name: collections.deque(maxlen=SAMPLES_KEPT)
                                                             for name in RAW}
        # Clean step intervals of the current full interval, newest last: (recording, seconds).
        self._interval: collections.deque[tuple[bool, float]] = collections.deque(maxlen=4 * PROBE_STEPS)
        self._after_full = False                 # the next step interval holds a full checkpoint's stall
        # The full checkpoint being charged: (clean step before it, extra seconds so far), or None.
        self._full_charge: list[float] | None = None
        # A full checkpoint costs training more than its stall: the steps that run while it is
        # copied and written share the CPU and memory bandwidth with it. Steps that end while one
        # is in flight are measured apart ("busy_step_s"), and the difference is charged to it.
        self._persist_in_flight = False
        self._last_step_end: float | None = None
        self._records_seen = 0

    def add(self, name: str, sample: float) -> None:
        """One sample of ``name`` (one of ``MEASURED``) from outside, e.g. a probe's ratio."""
        with self._lock:
            self.windows[name].add(sample)

    def count(self, name: str) -> int:
        """How many samples of ``name`` the window holds."""
        with self._lock:
            return len(self.windows[name].samples)

    # reports of the three threads -------------------------------------------------------
    def step_finished(self, now_s: float, optimizer_step_s: float, recording: bool) -> float | None:
        """Training thread, at ``now_s`` (time.perf_counter) right after the inner optimizer step;
        ``recording``: whether this step records a differential. Returns the step's interval when
        it is clean (no full checkpoint's stall or persist in it), else None."""
        with self._lock:
            clean_s = None
            if self._last_step_end is not None:
                interval_s = now_s - self._last_step_end
                busy = self._persist_in_flight
                if self._after_full:
                    name = "full_step_s" if recording else "bare_full_step_s"
                else:
                    name = ("busy_step_s" if busy else "step_s") if recording else \
                        ("bare_busy_step_s" if busy else "bare_step_s")
                    if not busy:
                        clean_s = interval_s
                self.windows[name].add(interval_s)
                charge = self._full_charge
                if charge is not None:
                    if clean_s is None:
                        charge[1] += interval_s - charge[0]
                    else:
                        self._charge_full_locked()
            self._after_full = False
            self._last_step_end = now_s
            self.windows["optimizer_step_s"].add(optimizer_step_s)
            if clean_s is not None:
                self._interval.append((recording, clean_s))
            return clean_s

    def step_recorded(self, record_s: float) -> None:
        """Training thread: what recording the step cost it (capture, compression, hand-over)."""
        with self._lock:
            self.windows["record_s"].add(record_s)

    def full_taken(self, stall_s: float, differentials: bool) -> None:
        """Training thread, when a full checkpoint's stall has ended; ``differentials``: the kind of
        step in force (its clean steps are what the full checkpoint's steps are charged against)."""
        with self._lock:
            self.windows["stall_s"].add(stall_s)
            self.samples["full_stall_s"].append(stall_s)
            self._after_full = True     # the next step interval holds the stall (see _full_cost_locked)
            self._charge_full_locked()  # the previous one, if no clean step came between
            recent = [s for rec, s in self._interval if rec == differentials] or \
                list(self.windows["step_s" if differentials else "bare_step_s"].samples)[-PROBE_STEPS:]
            if recent:
                self._full_charge = [statistics.median(recent[-2 * PROBE_STEPS:]), 0.0]
            self._persist_in_flight = True
            self._interval.clear()

    def _charge_full_locked(self) -> None:
        """The full checkpoint being charged has no more slow steps: one sample of its cost."""
        charge, self._full_charge = self._full_charge, None
        if charge is not None:
            self.windows["full_cost_s"].add(max(0.0, charge[1]))

    def full_persisted(self, persist_s: float, nbytes: int) -> None:
        """Full-writer thread, when a full checkpoint of ``nbytes`` is committed."""
        with self._lock:
            self._persist_in_flight = False
            self.windows["persist_s"].add(persist_s)
            self.windows["full_bytes"].add(float(nbytes))
            self.samples["full_persist_s"].append(persist_s)

    def batch_written(self, steps: int, write_s: float, nbytes: int) -> None:
        """Diff-writer thread, when a batch of ``steps`` records (``nbytes``) is committed."""
        with self._lock:
            self.windows["batch_write_s"].add(write_s)
            self.windows["batch_bytes"].add(float(nbytes))
            self.windows["batch_steps"].add(float(max(steps, 1)))
            self.samples["batch_write_s"].append(write_s)

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
            self.windows["decode_s"].add(elapsed)

    def resumed(self, load_s: float, replay_s: float, replayed: int) -> None:
        """recovery.resume, at its end: the full checkpoint took ``load_s`` to load and
        ``replayed`` records took ``replay_s`` to replay. What this process spent before being
        ready to train, besides those two, is its restart time (interpreter, imports, model build,
        wrap, planning the resume)."""
        age_s = process_age_s()
        with self._lock:
            if load_s > 0:
                self.windows["load_s"].add(load_s)
            if replayed > 0:
                self.windows["replay_record_s"].add(replay_s / replayed)
                self.windows["replay_records"].add(float(replayed))
                self.windows["replay_total_s"].add(replay_s)
            if age_s is not None:
                self.windows["restart_s"].add(max(0.0, age_s - load_s - replay_s))

    # earlier and later sessions ---------------------------------------------------------
    def load(self, directory: str) -> dict | None:
        """Add the samples earlier sessions kept in ``directory``'s CONTROLLER.json to the
        windows; return the settings kept beside them (None: no file). Raises
        controlstate.UnusableState for a file that cannot be used (nothing is added)."""
        found = read_state(directory)
        if found is None:
            return None
        samples, settings = found
        with self._lock:
            for name, values in samples.items():
                if name in self.windows:
                    self.windows[name].samples.extend(values[-WINDOW:])
        return settings

    def save(self, directory: str, settings: dict) -> None:
        """Replace ``directory``'s CONTROLLER.json with the samples of every window that holds any
        and ``settings`` (the policy's settings in force). Raises OSError."""
        with self._lock:
            samples = {name: list(window.samples) for name, window in self.windows.items() if window.samples}
        write_state(directory, samples, settings)

    # what the model is given -----------------------------------------------------------
    def measured(self, differentials: bool) -> Measured:
        """What a decision is made from; ``differentials``: whether the kind of step in force records."""
        with self._lock:
            return Measured(self._costs_locked(differentials), self._differentials_measured_locked(),
                            len(self.windows["full_cost_s"].samples), len(self.windows["record_ratio"].samples))

    def costs(self, differentials: bool) -> Costs | None:
        """The measured costs (medians of recent samples), or None until each has been seen."""
        with self._lock:
            return self._costs_locked(differentials)

    def differentials_measured(self) -> bool:
        """Whether steps that record differentials and their batch writes have been measured."""
        with self._lock:
            return self._differentials_measured_locked()

    def value(self, name: str) -> float | None:
        """The median of ``name``'s window (None: no sample yet)."""
        with self._lock:
            return self.windows[name].value

    def _differentials_measured_locked(self) -> bool:
        return all(self.windows[name].value is not None for name in ("step_s", "optimizer_step_s", "batch_write_s"))

    def _costs_locked(self, differentials: bool) -> Costs | None:
        """The model's inputs. Needs a full checkpoint persisted and steps timed with or without
        differentials; the differentials' own costs are 0 until measured (see
        ``differentials_measured``). ``differentials``: the kind of step in force."""
        v = {name: window.value for name, window in self.windows.items()}
        if v["stall_s"] is None or v["persist_s"] is None or (v["step_s"] is None and v["bare_step_s"] is None):
            return None
        in_thread_s = v["record_s"] or 0.0
        ratio = v["record_ratio"]
        fresh = "step_s" if differentials else "bare_step_s"   # the kind timed all the time
        if ratio is not None and v[fresh] is not None:
            # Probed: steps with differentials take ``ratio`` times as long as steps without,
            # timed side by side (so a change of the machine's load falls on both alike). Applied
            # to the kind of step timed now, as the other kind's samples may be old.
            with_s = v[fresh] if differentials else v[fresh] * ratio
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
        batch_writes = list(zip(self.windows["batch_write_s"].samples, self.windows["batch_bytes"].samples))
        writes = batch_writes + list(zip(self.windows["persist_s"].samples, self.windows["full_bytes"].samples))
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
        return Costs(step_s=step_s, record_s=record_s, stall_s=self._full_cost_locked(differentials),
                     persist_s=v["persist_s"], full_bytes=v["full_bytes"], batch_fixed_s=fixed_s,
                     diff_bytes_per_step=diff_bytes_per_step, write_bytes_per_s=bandwidth, replay_s=replay_s,
                     load_s=load_s, restart_s=v["restart_s"] or 0.0)

    def _replay_fit_locked(self) -> tuple[float, float] | None:
        """(fixed seconds per resume, seconds per record) of replay, from what resumes measured:
        total = fixed + per_record * records, fitted by least squares once resumes of different
        lengths were seen (a resume of two records spends most of its replay time setting up: its
        time per record is no measure of a long chain's); from one length alone, only if it is at
        least REPLAY_MIN_RECORDS records. None: not measured yet."""
        records = list(self.windows["replay_records"].samples)
        totals = list(self.windows["replay_total_s"].samples)
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

    def _full_cost_locked(self, differentials: bool) -> float:
        """What one full checkpoint costs the training thread: what the step whose interval holds
        its stall took longer than a clean step (the stall, and the persist's competition during
        that step), plus what the further steps overlapping the persist took longer than clean ones
        (about (persist - busy step) / busy step of them); never less than the stall. Compared within
        the kind of step in force (with or without differentials), or else the other."""
        stall_s, persist_s = self.windows["stall_s"].value or 0.0, self.windows["persist_s"].value or 0.0
        charged_s = self.windows["full_cost_s"].value
        if charged_s is not None:
            return max(stall_s, charged_s)
        kinds = [("full_step_s", "busy_step_s", "step_s"), ("bare_full_step_s", "bare_busy_step_s", "bare_step_s")]
        if not differentials:
            kinds.reverse()
        for full, busy, clean in kinds:
            full_s, busy_s, clean_s = (self.windows[name].value for name in (full, busy, clean))
            if clean_s is None or (full_s is None and busy_s is None):
                continue
            cost_s = max(stall_s, full_s - clean_s) if full_s is not None else stall_s
            if busy_s is not None:
                overlapped_s = persist_s - (busy_s if full_s is not None else 0.0)
                cost_s += max(0.0, busy_s - clean_s) * max(0.0, overlapped_s) / busy_s
            return cost_s
        return stall_s

    # reports ----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Median and max of the recent raw samples (``RAW``), in milliseconds, and how many there
        were; and ``full_iteration_cost_ms``, what one full checkpoint costs the iterations (beside
        ``full_stall``, the part of it that ``step()`` waits): the extra wall time of the step that
        takes it and of the steps its persist overlaps, over the clean steps before it (the
        controller weighs a full checkpoint by this; None until one was charged)."""
        with self._lock:
            samples = {name: list(values) for name, values in self.samples.items()}
            charged = list(self.windows["full_cost_s"].samples)
        out: dict[str, Any] = {"full_iteration_cost_count": len(charged),
                               "full_iteration_cost_median_ms": statistics.median(charged) * 1e3 if charged else None}
        for name, values in samples.items():
            key = name.removesuffix("_s")
            out[f"{key}_count"] = len(values)
            out[f"{key}_median_ms"] = statistics.median(values) * 1e3 if values else None
            out[f"{key}_max_ms"] = max(values) * 1e3 if values else None
        return out
