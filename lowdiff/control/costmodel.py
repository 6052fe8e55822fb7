"""The cost model behind the controller: the expected fraction of wall-clock time that checkpointing
and failures waste, for a full-checkpoint interval F and a differential batch size B, and the (F, B)
that minimise it under the pipeline, bandwidth, memory and recovery-time constraints.

Derivation and every assumption: docs/controller.md. Pure functions of frozen inputs (no clock, no
torch): the online controller, ``python -m lowdiff tune`` and experiments/tune_frequency.py all call
the same ``evaluate``/``solve``.
"""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class Costs:
    """Measured costs, in seconds and bytes.

    step_s: one training iteration without checkpointing work on the training thread.
    record_s: what recording a differential adds to each step (0 for full-only checkpointing).
    stall_s: training-thread stall of one full checkpoint.  persist_s: its background persist time.
    full_bytes: its size.  batch_fixed_s: the fixed cost of one differential batch write (open,
    fdatasync, rename, manifest commit).  diff_bytes_per_step: one step's record on disk.
    write_bytes_per_s: the device's sustained write bandwidth.  replay_s: replaying one differential
    (read + decode + optimizer step).  load_s: loading a full checkpoint.  restart_s: from a failure
    to the restarted process calling resume (scheduler, interpreter, imports, model build).
    step_var_s2: the variance of one step's wall time (s^2); a failure lands in a long step more
    often than in a short one, so the work it finds in progress is length-biased (0: every step
    takes its mean, the model's behaviour before this input existed; docs/controller.md).
    """

    step_s: float
    stall_s: float
    persist_s: float
    replay_s: float
    load_s: float
    record_s: float = 0.0
    full_bytes: float = 0.0
    batch_fixed_s: float = 0.0
    diff_bytes_per_step: float = 0.0
    write_bytes_per_s: float = math.inf
    restart_s: float = 0.0
    step_var_s2: float = 0.0

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"Costs.{field.name}={value!r} must be a number >= 0")
        if not self.step_s > 0:
            raise ValueError(f"Costs.step_s={self.step_s!r} must be > 0")
        if not self.write_bytes_per_s > 0:
            raise ValueError(f"Costs.write_bytes_per_s={self.write_bytes_per_s!r} must be > 0")

    def batch_write_s(self, batch_steps: int) -> float:
        """Write time of a batch of ``batch_steps`` records: fixed cost + bytes at the bandwidth."""
        return self.batch_fixed_s + batch_steps * self.diff_bytes_per_step / self.write_bytes_per_s

    def diff_share(self, batch_steps: int | None) -> float:
        """The share of the device the batch writes keep busy (0 without differentials)."""
        if batch_steps is None:
            return 0.0
        write_s = self.batch_write_s(batch_steps)
        base_s = max(self.step_s + self.record_s, write_s / batch_steps)
        return write_s / (batch_steps * base_s)

    def shared_persist_s(self, batch_steps: int | None) -> float:
        """How long a full checkpoint takes to persist beside batch writes of ``batch_steps``
        records: one device, so it gets the share they leave (``persist_s`` is its time alone)."""
        return self.persist_s / max(1.0 - self.diff_share(batch_steps), 0.01)


@dataclasses.dataclass(frozen=True)
class Limits:
    """The failure rate and the constraints of the search.

    max_utilisation: the share of the device that full persists plus differential writes may keep
    busy on average (the rest is headroom for bursts and for the training's own I/O).
    batch_memory_bytes: records held in memory before they are durable (max_pending_batches
    batches of B records each) must fit in this.
    """

    failure_rate_per_s: float
    max_recovery_s: float | None = None
    batch_memory_bytes: float = 256 * 2**20
    max_pending_batches: int = 2
    max_utilisation: float = 0.9
    max_full_every: int = 100_000
    max_batch_steps: int = 256

    def __post_init__(self):
        if not self.failure_rate_per_s > 0:
            raise ValueError(f"Limits.failure_rate_per_s={self.failure_rate_per_s!r} must be > 0")
        if self.max_recovery_s is not None and not self.max_recovery_s > 0:
            raise ValueError(f"Limits.max_recovery_s={self.max_recovery_s!r} must be > 0 or None")
        if not self.max_utilisation > 0:  # above 1: no bandwidth bound (solve's last resort)
            raise ValueError(f"Limits.max_utilisation={self.max_utilisation!r} must be > 0")
        for name in ("max_pending_batches", "max_full_every", "max_batch_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name}={getattr(self, name)!r} must be >= 1")


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """What the model predicts for one setting. ``batch_steps`` None: full checkpoints only."""

    full_every: int
    batch_steps: int | None
    waste: float             # expected fraction of wall-clock time not spent on useful steps
    overhead: float          # of which checkpointing costs without failures
    per_failure_s: float     # expected time one failure costs (restart, recovery, lost work, base full)
    worst_recovery_s: float  # load + replay of the longest chain resume may have to replay
    violated: tuple[str, ...] = ()
    # Of per_failure_s, the time a session spends restarting, loading, replaying and taking its
    # base checkpoint before the next failure cuts it (the rest is work lost).
    recovery_s: float = 0.0
    # The session the waste is computed for: nothing kept until dead_s (restart, load, replay, base
    # checkpoint, and the first chunk's write or persist latency) has passed, then chunk_steps
    # steps at a time, each chunk chunk_s long on average, with variance chunk_var_s2.
    dead_s: float = 0.0
    chunk_s: float = 0.0
    chunk_steps: int = 0
    chunk_var_s2: float = 0.0

    @property
    def feasible(self) -> bool:
        return not self.violated


def evaluate(costs: Costs, limits: Limits, full_every: int, batch_steps: int | None) -> Evaluation:
    """Expected waste of checkpointing every ``full_every`` steps with differentials batched
    ``batch_steps`` at a time (None: no differentials), and which constraints it breaks."""
    diffs = batch_steps is not None
    base_s = costs.step_s + (costs.record_s if diffs else 0.0)       # a step, without full checkpoints
    if batch_steps is not None:
        # A writer that cannot keep up paces training (step() blocks on pending batches).
        base_s = max(base_s, costs.batch_write_s(batch_steps) / batch_steps)
    step_s = base_s + costs.stall_s / full_every                     # a step, fulls amortised
    persist_s = costs.shared_persist_s(batch_steps)                  # slowed by the batch writes
    rate = limits.failure_rate_per_s
    if batch_steps is not None:
        write_s = costs.batch_write_s(batch_steps)
        chunk_s, latency_s = batch_steps * step_s, write_s       # a batch is durable write_s after it ends
        chunk_steps = batch_steps
        lost_steps = batch_steps / 2 + write_s / step_s
        # (A session's base checkpoint makes the chain shorter than F/2 when sessions are short;
        # left out: on the safe side, and it keeps the waste unimodal in F, docs/controller.md.)
        replay_steps = max(0.0, full_every / 2 + persist_s / step_s - lost_steps)
        worst_recovery_s = costs.load_s + costs.replay_s * (full_every + persist_s / base_s)
    else:
        write_s = 0.0
        chunk_s, latency_s = full_every * step_s, persist_s      # a full is durable persist_s after it
        chunk_steps = full_every
        replay_steps = 0.0
        worst_recovery_s = costs.load_s
    # Before a session makes anything durable: restart, load, replay, its base checkpoint's stall.
    before_s = costs.restart_s + costs.load_s + costs.replay_s * replay_steps + costs.stall_s
    # Steps independent: a chunk of n steps varies n times as much as one step.
    chunk_var_s2 = chunk_steps * costs.step_var_s2
    lost_share = _lost_share(rate, before_s + latency_s, chunk_s, chunk_var_s2)
    # The expected wall time one failure costs (rare failures: before_s + latency_s + chunk_s / 2
    # + chunk_var / (2 chunk_s), i.e. restart + load + replay + base checkpoint + the steps lost,
    # the chunk in progress length-biased, docs/controller.md).
    per_failure_s = lost_share / rate
    waste = 1.0 - (costs.step_s / step_s) * (1.0 - lost_share)
    overhead = 1.0 - costs.step_s / step_s
    violated = []
    if persist_s > full_every * base_s:
        violated.append("persist")
    utilisation = costs.persist_s / (full_every * base_s)
    if batch_steps is not None:
        utilisation += write_s / (batch_steps * base_s)
    if utilisation > limits.max_utilisation:
        violated.append("bandwidth")
    if batch_steps is not None and \
            limits.max_pending_batches * batch_steps * costs.diff_bytes_per_step > limits.batch_memory_bytes:
        violated.append("memory")
    if limits.max_recovery_s is not None and worst_recovery_s > limits.max_recovery_s:
        violated.append("recovery")
    recovery_s = -math.expm1(-rate * before_s) / rate      # E[min(session, before_s)]
    return Evaluation(full_every, batch_steps, waste, overhead, per_failure_s, worst_recovery_s, tuple(violated),
                      recovery_s, before_s + latency_s, chunk_s, chunk_steps, chunk_var_s2)


def _lost_share(rate: float, before_s: float, chunk_s: float, chunk_var_s2: float = 0.0) -> float:
    """The share of wall time that failures (a Poisson process of ``rate``) leave nothing durable
    for, exactly: a session keeps nothing until ``before_s`` has passed (a failure in it starts
    the next session), then makes ``chunk_s`` of work durable at a time. With X the session's
    length (exponential), it keeps chunk_s * E[#{k >= 1: before_s + k chunk_s <= X}] =
    chunk_s * exp(-rate before_s) / expm1(rate chunk_s), and sessions start at ``rate``: the kept
    share is exp(-rate before_s) h(rate chunk_s), h(x) = x / expm1(x). First order: rate *
    (before_s + chunk_s / 2), the cost of a failure times the rate (Young's model); that is what
    the model charged before, and it overstates the loss once failures come within a few
    intervals and restarts (then a session cut short loses what it ran, not a whole failure's
    cost): at rate * (before_s + chunk_s / 2) = 0.5 the share kept is 0.58-0.61, not 0.5
    (docs/controller.md).

    Chunks whose lengths vary (``chunk_var_s2`` > 0, taken as Gamma distributed with that mean
    and variance, shape k = chunk_s^2 / var, scale t = var / chunk_s): the work kept per session is
    E[C e^(-rate C)] / (1 - E[e^(-rate C)]) times exp(-rate before_s), and h becomes
    rate chunk_s / ((1 + rate t) expm1(k log1p(rate t))); to first order a failure then loses
    chunk_s / 2 + var / (2 chunk_s) of the chunk in progress, not chunk_s / 2 (a failure lands in
    a long chunk more often than in a short one)."""
    x = rate * chunk_s
    rate_t = rate * chunk_var_s2 / chunk_s if chunk_s > 0 else 0.0
    if 0 < rate_t < 1e-6 and x < 1e-4:      # rare failures: the first order, without cancellation
        not_h = (x + rate_t) / 2 - x * x / 12
    elif rate_t > 0:
        y = (chunk_s / (chunk_var_s2 / chunk_s)) * math.log1p(rate_t)      # k log1p(rate t), -> x as t -> 0
        not_h = 1.0 - x / ((1.0 + rate_t) * math.expm1(min(y, 700.0)))
    else:
        # 1 - h(x), without the cancellation of 1 - x / expm1(x) for small x.
        not_h = x / 2 - x * x / 12 if x < 1e-4 else 1.0 - x / math.expm1(min(x, 700.0))
    return not_h + (1.0 - not_h) * -math.expm1(-rate * before_s)


def _full_every_bounds(costs: Costs, limits: Limits, batch_steps: int | None,
                       recovery_bound: bool) -> tuple[int, int]:
    """The feasible interval [lo, hi] of F for this B (lo > hi: none). Uses the step time without
    amortised fulls, which is shorter, so the bounds are on the safe side."""
    diffs = batch_steps is not None
    base_s = costs.step_s + (costs.record_s if diffs else 0.0)
    diff_share = costs.batch_write_s(batch_steps) / (batch_steps * base_s) if batch_steps is not None else 0.0
    room = limits.max_utilisation - diff_share
    if room <= 0:
        return 1, 0
    persist_s = costs.shared_persist_s(batch_steps)
    lo = max(1, math.ceil(persist_s / base_s - 1e-9), math.ceil(costs.persist_s / (base_s * room) - 1e-9))
    hi = limits.max_full_every
    if recovery_bound and diffs and limits.max_recovery_s is not None:
        if costs.replay_s > 0:
            hi = min(hi, math.floor((limits.max_recovery_s - costs.load_s) / costs.replay_s - persist_s / base_s))
        elif costs.load_s > limits.max_recovery_s:
            hi = 0
    return lo, hi


def _best_full_every(costs: Costs, limits: Limits, batch_steps: int | None, lo: int, hi: int) -> Evaluation:
    """The waste is unimodal in F (log(1 - waste) is a sum of terms concave in F: docs/controller.md;
    tests/unit/test_costmodel.py checks the search against brute force), so an integer
    ternary search over [lo, hi] finds the minimum."""
    def waste(f: int) -> float:
        return evaluate(costs, limits, f, batch_steps).waste

    while hi - lo > 2:
        third = (hi - lo) // 3
        a, b = lo + third, hi - third
        if waste(a) <= waste(b):
            hi = b
        else:
            lo = a
    return min((evaluate(costs, limits, f, batch_steps) for f in range(lo, hi + 1)), key=lambda e: e.waste)


def solve(costs: Costs, limits: Limits, *, differentials: bool | str = True, full_every: int | None = None,
          batch_steps: int | None = None) -> Evaluation:
    """The (F, B) of least expected waste that meets every constraint; ``full_every`` or
    ``batch_steps`` given: that one is fixed and only the other is chosen; ``differentials=False``:
    the best F for full checkpoints only; ``differentials="auto"``: the better of the two (a
    feasible setting before one that breaks a constraint). When ``max_recovery_s`` cannot be met,
    the best setting without that bound is returned with "recovery" in ``violated``; when nothing
    keeps the writers within the bandwidth, the least-utilising setting is returned likewise."""
    if differentials == "auto":
        both = [solve(costs, limits, differentials=d, full_every=full_every, batch_steps=batch_steps)
                for d in (True, False)]
        return min(both, key=lambda e: (len(e.violated), e.waste))
    if not isinstance(differentials, bool):
        raise ValueError(f"differentials={differentials!r} must be True, False or 'auto'")
    for recovery_bound in (True, False):
        best = _search(costs, limits, differentials, recovery_bound, full_every, batch_steps)
        if best is not None:
            if not recovery_bound:
                best = evaluate(costs, limits, best.full_every, best.batch_steps)
            return best
    # Nothing fits the bandwidth: the least waste without that bound (a writer that cannot keep
    # up paces training, which evaluate charges), reported as violating it. Memory stays a bound.
    relaxed = dataclasses.replace(limits, max_utilisation=1e9, max_recovery_s=None)
    best = _search(costs, relaxed, differentials, False, full_every, batch_steps)
    if best is None:  # not even the persist pipeline fits: the rarest fulls
        best = evaluate(costs, relaxed, full_every or limits.max_full_every,
                        (batch_steps or 1) if differentials else None)
    return evaluate(costs, limits, best.full_every, best.batch_steps)


def replay_estimate(optimizer_step_s: float, copy_s: float, read_s: float, decode_s: float, workers: int) -> float:
    """Replay time per differential before any resume was measured. recovery.pipeline.replay applies records
    in order on one thread (copy into the gradients + optimizer step) while ``workers`` threads read
    and decode the next ones: per record, the slower of the two stages (not their sum)."""
    return max(optimizer_step_s + copy_s, (read_s + decode_s) / max(1, workers))


def _memory_batch_cap(costs: Costs, limits: Limits) -> int:
    if costs.diff_bytes_per_step <= 0:
        return limits.max_batch_steps
    return max(1, int(limits.batch_memory_bytes // (limits.max_pending_batches * costs.diff_bytes_per_step)))


def _search(costs: Costs, limits: Limits, differentials: bool, recovery_bound: bool,
            fixed_full_every: int | None, fixed_batch_steps: int | None) -> Evaluation | None:
    """Every B from 1 up, each with its best F. When replaying a step is cheaper than redoing it
    (the case differentials exist for), a larger B loses more steps per failure; it helps only by
    lowering F's lower bound and by leaving full persists more of the device (a shorter persist,
    less to replay; that gain shrinks as B grows): once the bound no longer binds, stop at the
    first B that wastes more than the one before. (Otherwise a lost step costs less than a
    replayed one and every B is tried.)"""
    def best_for(batch_steps: int | None) -> Evaluation | None:
        lo, hi = _full_every_bounds(costs, limits, batch_steps, recovery_bound)
        if fixed_full_every is not None:
            lo, hi = max(lo, fixed_full_every), min(hi, fixed_full_every)
        return _best_full_every(costs, limits, batch_steps, lo, hi) if lo <= hi else None

    if not differentials:
        return best_for(None)
    if fixed_batch_steps is not None:
        return best_for(fixed_batch_steps)
    best: Evaluation | None = None
    previous: Evaluation | None = None
    for batch_steps in range(1, min(limits.max_batch_steps, _memory_batch_cap(costs, limits)) + 1):
        found = best_for(batch_steps)
        if found is None:
            continue
        if best is None or found.waste < best.waste:
            best = found
        if costs.replay_s <= costs.step_s and previous is not None and found.waste >= previous.waste and \
                found.full_every > _full_every_bounds(costs, limits, batch_steps, recovery_bound)[0]:
            break
        previous = found
    return best


def young_daly_full_every(costs: Costs, limits: Limits) -> int:
    """Daly's higher-order optimum for full checkpoints only (no differentials), with the training
    stall as the checkpoint cost (the persist runs in the background); never below what the persist
    pipeline allows. (Daly's interval does not depend on the restart time.)"""
    mtbf_s = 1.0 / limits.failure_rate_per_s
    delta = max(costs.stall_s, 1e-9)
    if delta < 2 * mtbf_s:
        x = delta / (2 * mtbf_s)
        interval_s = math.sqrt(2 * delta * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - delta
    else:
        interval_s = mtbf_s
    return max(1, round(interval_s / costs.step_s), math.ceil(costs.persist_s / costs.step_s - 1e-9))


def checkfreq_full_every(costs: Costs, overhead_limit: float = 0.05) -> int:
    """CheckFreq's policy (Mohan et al., FAST'21): checkpoint as often as the persist pipeline
    allows (one persist in flight), backing off while the stall costs more than ``overhead_limit``
    of the training time."""
    full_every = max(1, math.ceil(costs.persist_s / costs.step_s - 1e-9))
    while costs.stall_s / (full_every * costs.step_s) > overhead_limit:
        full_every *= 2
    return full_every


# ---------------------------------------------------------------- the tuner (python -m lowdiff tune)
FIXED_CHOICES = ((100, 10), (1000, 10), (50, 1), (500, 32))


def costs_from_stats(stats: dict, **overrides: float) -> Costs:
    """The measured costs in a run's ``opt.stats()`` (saved as JSON), with ``overrides`` (None
    values ignored) replacing or completing them."""
    measured = (stats.get("controller") or {}).get("costs") or {}
    values = {**measured, **{k: v for k, v in overrides.items() if v is not None}}
    missing = [f.name for f in dataclasses.fields(Costs) if f.default is dataclasses.MISSING and f.name not in values]
    if missing:
        raise ValueError(f"costs missing: {', '.join(missing)} (not in the stats and not given as flags)")
    return Costs(**{f.name: float(values[f.name]) for f in dataclasses.fields(Costs) if f.name in values})


def tune_table(costs: Costs, limits: Limits,
               fixed: tuple[tuple[int, int], ...] = FIXED_CHOICES) -> list[tuple[str, Evaluation]]:
    """The recommended setting, the best with full checkpoints only, Young/Daly and CheckFreq on
    full checkpoints only, and ``fixed`` (full_every, batch_steps) settings, each with the model's
    prediction."""
    rows = [("recommended", solve(costs, limits)),
            ("recommended, diffs auto", solve(costs, limits, differentials="auto")),
            ("best full-only", solve(costs, limits, differentials=False)),
            ("Young/Daly, full-only", evaluate(costs, limits, young_daly_full_every(costs, limits), None)),
            ("CheckFreq, full-only", evaluate(costs, limits, checkfreq_full_every(costs), None))]
    rows += [("fixed", evaluate(costs, limits, f, b)) for f, b in fixed]
    return rows
