"""The controller's policy: the settings in force (``full_every``, ``batch_steps``, differentials
on/off) and how they change — the learning phase, the probes that time steps without (or with)
differentials, and the hysteresis over lowdiff.control.costmodel's optimum.

A plain object driven by explicit inputs, with no lock, no clock and no I/O: what the cost meter
measured (``Measured``), each step's end (whether it recorded, its clean interval), each full
checkpoint taken, each batch written, and the time a decision is stamped with. The online
controller (lowdiff.control.controller) drives it from three threads behind its lock;
experiments/tune_frequency.py drives it directly, so simulation and training run this one code.
Derivation of the model: docs/controller.md.
"""
from __future__ import annotations

import collections
import dataclasses
import statistics
from typing import NamedTuple

from lowdiff.control.costmodel import Costs, Evaluation, Limits, evaluate, solve

# The guess in force before anything is measured (docs/controller.md, "Learning phase"): the
# shortest interval the probe can run in, and one record per write — every cost is measured within
# the first steps, the least memory is held and the least work is lost while the guess is in force.
AUTO_INITIAL_FULL_EVERY = 16
AUTO_INITIAL_BATCH_STEPS = 1
MAX_BATCH_STEPS = 256
MAX_FULL_EVERY = 100_000
RESOLVE_EVERY_BATCHES = 8
HYSTERESIS = 0.05             # change only for a predicted waste at least this much (relative) lower ...
HYSTERESIS_ABS = 1e-4         # ... and by at least this much of the wall-clock time
# The probe (differentials="auto" only): what recording costs is what steps with differentials
# take longer than steps without, timed side by side now and then (see Policy._plan_probe).
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


@dataclasses.dataclass(frozen=True)
class Measured:
    """What the cost meter knows when a decision is due: the model's inputs (None until a full
    checkpoint persisted and steps were timed), whether steps with differentials and their batch
    writes were timed, and how many samples of a full checkpoint's cost (``full_costs``) and of
    the probe's ratio (``probes``) its windows hold."""

    costs: Costs | None
    differentials_measured: bool
    full_costs: int
    probes: int


@dataclasses.dataclass
class Probe:
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


class Change(NamedTuple):
    """An applied decision and the model's view of the settings it replaced."""

    decision: Decision
    replaced: Evaluation


class Policy:
    """The settings in force and the rules that change them (see the module docstring).

    ``full_every``, ``batch_steps`` and ``differentials_wanted`` may also be set from outside
    (fixed settings changed by hand, tests); ``history`` holds every applied ``Decision`` and
    ``current`` the model's prediction for the settings in force."""

    def __init__(self, limits: Limits, *, full_every: int | str, batch_steps: int | str,
                 differentials: bool | str):
        self.limits = limits
        self.auto_full = full_every == "auto"
        self.auto_batch = batch_steps == "auto"
        self.auto_differentials = differentials == "auto"
        # (WrapConfig allows an int or "auto" for each.)
        self.full_every: int = full_every if isinstance(full_every, int) else AUTO_INITIAL_FULL_EVERY
        self.batch_steps: int = batch_steps if isinstance(batch_steps, int) else AUTO_INITIAL_BATCH_STEPS
        # Whether differentials are wanted (the session switches at a full checkpoint). "auto"
        # starts with them: their costs must be measured before they can be judged.
        self.differentials_wanted: bool = differentials is not False
        self.probe: Probe | None = None
        self.probes = 0                          # probes that gave a sample
        self.history: list[Decision] = []
        self.current: Evaluation | None = None   # the model's prediction for the settings in force
        self._fulls_since_probe = 0
        self._fulls_seen = 0
        self._steps_seen = 0
        self._steps_since_full = 0
        # Clean step intervals of the current full interval, newest last: (recording, seconds).
        self._interval: collections.deque[tuple[bool, float]] = collections.deque(maxlen=4 * PROBE_STEPS)
        self._batches_since_solve = 0
        self._full_costs_decided = -1            # full_cost_s samples behind the last decision

    @property
    def auto(self) -> bool:
        """Whether anything is left to the policy (else it only evaluates the settings in force)."""
        return self.auto_full or self.auto_batch or self.auto_differentials

    @property
    def differentials(self) -> bool:
        """Whether the next step records a differential: the setting in force
        (``differentials_wanted``), the other way round while a probe runs."""
        probe = self.probe
        return probe.recording if probe is not None else self.differentials_wanted

    def settings(self) -> dict:
        """The settings in force, as kept in CONTROLLER.json."""
        return {"full_every": self.full_every, "batch_steps": self.batch_steps,
                "differentials": self.differentials_wanted}

    # earlier sessions ---------------------------------------------------------
    def adopt(self, settings: dict) -> None:
        """Continue with the auto settings an earlier session chose (ignored unless sensible)."""
        def positive_int(value, cap):
            return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= cap

        if self.auto_full and positive_int(settings.get("full_every"), MAX_FULL_EVERY):
            self.full_every = settings["full_every"]
        if self.auto_batch and positive_int(settings.get("batch_steps"), MAX_BATCH_STEPS):
            self.batch_steps = settings["batch_steps"]
        if self.auto_differentials and isinstance(settings.get("differentials"), bool):
            self.differentials_wanted = settings["differentials"]

    def continue_from(self, measured: Measured, reason: str) -> Decision | None:
        """The settings in force (adopted from earlier sessions) as a decision already, made from
        ``measured`` (changed from now on only with hysteresis); None when there is nothing to
        decide or the costs of what is in force are not known yet."""
        costs = measured.costs
        if not self.auto or costs is None or (self.differentials_wanted and not measured.differentials_measured):
            return None
        self.current = self._in_force(costs)
        decision = Decision(0, 0.0, self.full_every, self.current.batch_steps, self.current.waste, None, reason,
                            dataclasses.asdict(costs))
        self.history.append(decision)
        return decision

    # what happened --------------------------------------------------------------
    def step_finished(self, recording: bool, clean_s: float | None, probes: int) -> float | None:
        """A step ended; ``recording``: whether it recorded a differential; ``clean_s``: its
        interval when neither a full checkpoint's stall nor its persist was in it (else None);
        ``probes``: the probe samples the meter holds (read only with differentials="auto").
        Runs, ends or starts a probe (which sets what the next step does); returns the sample of
        ``record_ratio`` a probe that ended gave."""
        self._steps_seen += 1
        self._steps_since_full += 1
        if clean_s is not None:
            self._interval.append((recording, clean_s))
        if self.auto_differentials:
            return self._plan_probe(recording, clean_s, probes)
        return None

    def full_taken(self) -> float | None:
        """A full checkpoint was taken (its stall ended). Returns a probe's sample as
        ``step_finished`` does (a probe without differentials ends here)."""
        self._steps_since_full = 0
        self._fulls_seen += 1
        self._fulls_since_probe += 1
        self._interval.clear()
        if self.probe is not None and not self.probe.recording:
            return self.end_probe()   # full_every shrank under it: differentials restart at the next full
        return None

    def batch_written(self) -> bool:
        """A batch was written: whether a decision is due (every RESOLVE_EVERY_BATCHES batches,
        and at every batch until the first decision)."""
        self._batches_since_solve += 1
        return self._batches_since_solve >= RESOLVE_EVERY_BATCHES or not self.history

    # probes ---------------------------------------------------------------------
    def _plan_probe(self, recording: bool, clean_s: float | None, probes: int) -> float | None:
        """After a step: run, end or start a probe.

        With differentials on, the PROBE_STEPS steps before a full checkpoint that is due anyway
        record nothing (the batch before them is sealed; the full checkpoint restarts the chain),
        and are compared with the clean steps just before them. The first probe does not wait for
        a full checkpoint: it runs once PROBE_STEPS clean steps are timed, and the step after it
        takes an extra full checkpoint. With differentials off, recording starts at a full
        checkpoint that is due anyway and stops once PROBE_STEPS clean steps with it are timed,
        compared with the clean steps without it before that full checkpoint. Each probe gives one
        sample of ``record_ratio``. Its price: the few steps of an "on" probe are durable only
        with the full checkpoint after them."""
        probe, place = self.probe, self._steps_since_full + 1    # the next step's place in the interval
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
            return self.end_probe() if ended else None
        due = probes < PROBE_WARMUP or self._fulls_since_probe >= PROBE_EVERY_FULLS
        if not due or self.full_every < PROBE_MIN_FULL_EVERY:
            return None
        if self.differentials_wanted:
            baseline = [s for rec, s in self._interval if rec][-PROBE_STEPS:]
            first = not probes
            if len(baseline) >= 2 and (place == self.full_every - PROBE_STEPS or
                                       (first and len(baseline) >= PROBE_STEPS and
                                        place < self.full_every - PROBE_STEPS)):
                self.probe = Probe(False, baseline, self._fulls_seen)
        elif place == self.full_every:
            baseline = [s for rec, s in self._interval if not rec][-PROBE_STEPS:]
            if len(baseline) >= 2:
                self.probe = Probe(True, baseline, self._fulls_seen)
        return None

    def end_probe(self) -> float | None:
        """End the probe in progress; its sample of ``record_ratio`` (steps with differentials over
        steps without, medians), or None when it timed too few steps."""
        probe, self.probe = self.probe, None
        if probe is None:
            return None
        self._fulls_since_probe = 0
        if len(probe.samples) < 2 or len(probe.baseline) < 2:
            return None
        with_s, without_s = (probe.samples, probe.baseline) if probe.recording else (probe.baseline, probe.samples)
        self.probes += 1
        return statistics.median(with_s) / max(statistics.median(without_s), 1e-9)

    # decisions --------------------------------------------------------------
    def _in_force(self, costs: Costs) -> Evaluation:
        return evaluate(costs, self.limits, self.full_every, self.batch_steps if self.differentials_wanted else None)

    def resolve(self, measured: Measured, why: str, time_s: float) -> Change | None:
        """Solve the model again for ``measured``; apply its answer if it beats the settings in
        force by the hysteresis margin, or if those break a constraint. ``time_s`` stamps the
        decision. Returns the applied change (None: the settings in force stay)."""
        self._batches_since_solve = 0
        costs = measured.costs
        if costs is None:
            return None
        if self.differentials_wanted and not measured.differentials_measured:
            return None   # the costs of what is in force are not known yet
        self.current = self._in_force(costs)
        if not self.auto:
            return None
        if self.auto_differentials and self.differentials_wanted and not self.history and \
                not measured.probes and self.full_every >= PROBE_MIN_FULL_EVERY and \
                self._fulls_seen < DECIDE_WITHOUT_PROBE_FULLS:
            return None   # the first probe is a few steps away: until it, recording looks cheaper than it is
        full_costs = measured.full_costs
        learning = full_costs < LEARNING_FULL_COSTS
        if learning and self.history and full_costs <= self._full_costs_decided and not self.current.violated:
            return None   # learning: one decision per measured full checkpoint
        # Differentials are judged only once measured; without consent ("auto") they stay as set,
        # and with it they stay on until the probe has sampled what they cost a few times.
        probing = self.auto_differentials and self.differentials_wanted and measured.probes < PROBE_WARMUP and \
            (self.auto_full or self.full_every >= PROBE_MIN_FULL_EVERY) and \
            self._fulls_seen < PROBE_WARMUP + DECIDE_WITHOUT_PROBE_FULLS
        choice: bool | str = "auto" if self.auto_differentials and measured.differentials_measured and \
            not probing else self.differentials_wanted
        best = solve(costs, self.limits, differentials=choice, full_every=None if self.auto_full else self.full_every,
                     batch_steps=None if self.auto_batch else self.batch_steps)
        optimum = best
        if learning or probing:
            best = self._limited(costs, best, learning, probing)
        decide = choose(self.current, best, first=not self.history)
        if decide is None:
            return None
        reason = f"{why}: {decide}"
        if best is not optimum:
            reason += (f" (learning, {full_costs} full checkpoint(s) measured, {measured.probes} probe(s): limited "
                       f"from the optimum {optimum.full_every}/{optimum.batch_steps or 'off'})")
        self._full_costs_decided = full_costs
        replaced = self.current
        decision = Decision(self._steps_seen, time_s, best.full_every, best.batch_steps, best.waste, replaced.waste,
                            reason, dataclasses.asdict(costs))
        self.history.append(decision)
        self.full_every = best.full_every
        self.differentials_wanted = best.batch_steps is not None
        if best.batch_steps is not None:
            self.batch_steps = best.batch_steps   # kept while off: the size to use if they return
        self.current = best
        return Change(decision, replaced)

    def _limited(self, costs: Costs, best: Evaluation, learning: bool, probing: bool) -> Evaluation:
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
