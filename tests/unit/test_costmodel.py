"""The cost model: its optimum is the one derived in docs/controller.md, constraints bind where
they should, and the baselines follow their published rules."""
import dataclasses
import math

import numpy as np
import pytest

from lowdiff.control.costmodel import (
    Costs,
    Limits,
    checkfreq_full_every,
    evaluate,
    replay_estimate,
    solve,
    young_daly_full_every,
)

PER_HOUR = 1 / 3600


def costs(**changes):
    base = dict(step_s=0.1, stall_s=0.05, persist_s=0.5, replay_s=0.01, load_s=0.3, batch_fixed_s=0.002,
                diff_bytes_per_step=1e5, write_bytes_per_s=1e9, full_bytes=6e7, restart_s=5.0)
    return Costs(**{**base, **changes})


def brute_force(c, limits, batch_range=range(1, 65), full_range=range(1, 5001)):
    return min((evaluate(c, limits, f, b) for b in batch_range for f in full_range
                if evaluate(c, limits, f, b).feasible), key=lambda e: e.waste)


def test_full_interval_is_young_scaled_by_the_replay_to_step_ratio():
    """First order: S/(F T) + lambda F r / 2 is least at F = sqrt(2 S / (lambda r T)): Young's
    interval sqrt(2 S / lambda) stretched by sqrt(T / r) (replay replaces recomputation)."""
    c, limits = costs(), Limits(failure_rate_per_s=PER_HOUR)
    best = solve(c, limits)
    expected = math.sqrt(2 * c.stall_s / (limits.failure_rate_per_s * c.replay_s * c.step_s))
    assert best.feasible and best.batch_steps == 1
    assert abs(best.full_every - expected) / expected < 0.02


def test_full_only_interval_is_young():
    c, limits = costs(), Limits(failure_rate_per_s=PER_HOUR)
    best = solve(c, limits, differentials=False)
    young_steps = math.sqrt(2 * c.stall_s / limits.failure_rate_per_s) / c.step_s
    assert best.batch_steps is None and abs(best.full_every - young_steps) / young_steps < 0.02
    assert abs(young_daly_full_every(c, limits) - young_steps) / young_steps < 0.02


@pytest.mark.parametrize("changes,rate", [({}, PER_HOUR), ({"batch_fixed_s": 0.3}, PER_HOUR),
                                          ({"persist_s": 20.0}, 12 * PER_HOUR), ({"replay_s": 0.2}, 60 * PER_HOUR)])
def test_solver_finds_the_brute_force_optimum(changes, rate):
    c, limits = costs(**changes), Limits(failure_rate_per_s=rate)
    best, exhaustive = solve(c, limits), brute_force(c, limits)
    assert best.waste == pytest.approx(exhaustive.waste, rel=1e-9)
    assert best.feasible


def test_persist_pipeline_binds_full_interval():
    """A full checkpoint must finish persisting before the next one is taken."""
    c, limits = costs(persist_s=30.0), Limits(failure_rate_per_s=3600 * PER_HOUR)
    best = solve(c, limits)
    assert best.full_every * c.step_s >= c.persist_s
    assert evaluate(c, limits, best.full_every - 1, best.batch_steps).violated


def test_batch_write_fixed_cost_binds_batch_size_through_bandwidth():
    """Writes of 0.25 s fixed cost each cannot run every step of 0.1 s: B grows until the writer
    keeps up, and no smaller B is feasible."""
    c, limits = costs(batch_fixed_s=0.25), Limits(failure_rate_per_s=PER_HOUR)
    best = solve(c, limits)
    assert best.batch_steps > 2 and best.feasible
    assert "bandwidth" in evaluate(c, limits, best.full_every, 2).violated


def test_full_persists_get_the_device_the_batch_writes_leave():
    """One device: beside batch writes that keep it 83% busy (B=3 of the test above) a 0.5 s
    persist takes 3 s, so more steps are replayed after a failure; B=4 leaves it 37% more and
    wastes less, though B=3 meets every bound. The solver finds what brute force finds."""
    c, limits = costs(batch_fixed_s=0.25), Limits(failure_rate_per_s=PER_HOUR)
    share = c.batch_write_s(3) / (3 * c.step_s)
    assert c.shared_persist_s(3) == pytest.approx(0.5 / (1 - share)) and c.shared_persist_s(None) == 0.5
    best = solve(c, limits)
    assert best.batch_steps >= 4 and evaluate(c, limits, best.full_every, 3).feasible
    assert best.waste < solve(c, limits, batch_steps=3).waste
    assert best.waste == pytest.approx(brute_force(c, limits).waste, rel=1e-9)


def test_memory_budget_caps_batch_size():
    c = costs(batch_fixed_s=0.25, diff_bytes_per_step=1e6)
    limits = Limits(failure_rate_per_s=PER_HOUR, batch_memory_bytes=4e6, max_pending_batches=2)
    best = solve(c, limits)
    assert best.batch_steps <= 2
    assert best.violated  # 0.25 s per write of at most two steps cannot keep up: said, not hidden


def test_recovery_bound_shortens_the_chain():
    c = costs()
    free = solve(c, Limits(failure_rate_per_s=PER_HOUR))
    bounded = solve(c, Limits(failure_rate_per_s=PER_HOUR, max_recovery_s=2.0))
    assert bounded.worst_recovery_s <= 2.0 < free.worst_recovery_s
    assert bounded.full_every < free.full_every and bounded.feasible


def test_unreachable_recovery_bound_is_reported():
    best = solve(costs(load_s=5.0), Limits(failure_rate_per_s=PER_HOUR, max_recovery_s=1.0))
    assert "recovery" in best.violated


def test_fixed_batch_only_chooses_the_interval():
    c, limits = costs(), Limits(failure_rate_per_s=PER_HOUR)
    best = solve(c, limits, batch_steps=16)
    assert best.batch_steps == 16
    assert best.waste == pytest.approx(brute_force(c, limits, batch_range=[16]).waste, rel=1e-9)


def test_waste_grows_with_failure_rate_and_checkfreq_backs_off():
    c = costs()
    rare, often = (solve(c, Limits(failure_rate_per_s=r)).waste for r in (PER_HOUR / 12, PER_HOUR))
    assert 0 < rare < often < 1
    assert checkfreq_full_every(c) == 10          # ceil(P/T) = 5 would cost S/(5 T) = 10% > 5%
    assert checkfreq_full_every(costs(stall_s=0.001)) == 5


@pytest.mark.parametrize("field,value", [("step_s", 0.0), ("stall_s", -1.0), ("replay_s", float("nan"))])
def test_costs_refuse_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        costs(**{field: value})


@pytest.mark.parametrize("record_s,off", [(0.0005, False), (0.01, True)])
def test_differentials_auto_takes_the_better_of_the_two(record_s, off):
    """With fulls stalling 5 steps, recording 0.5% of a step saves more (lost work, rarer fulls)
    than it costs; 10% does not."""
    c, limits = costs(record_s=record_s, stall_s=0.5), Limits(failure_rate_per_s=PER_HOUR)
    best = solve(c, limits, differentials="auto")
    with_diffs, full_only = solve(c, limits), solve(c, limits, differentials=False)
    assert (best.batch_steps is None) == off
    assert best.waste == min(with_diffs.waste, full_only.waste)
    assert solve(c, limits).batch_steps is not None    # without consent they stay


def test_differentials_auto_keeps_a_fixed_setting_fixed():
    c, limits = costs(record_s=0.02, stall_s=0.005), Limits(failure_rate_per_s=PER_HOUR)
    best = solve(c, limits, differentials="auto", full_every=40)
    assert best.full_every == 40 and best.batch_steps is None


def test_replay_estimate_is_the_slower_stage_of_the_pipeline():
    assert replay_estimate(0.01, 0.002, 0.004, 0.02, workers=2) == pytest.approx(0.012)   # apply bound
    assert replay_estimate(0.01, 0.002, 0.01, 0.04, workers=2) == pytest.approx(0.025)    # decode bound
    assert replay_estimate(0.01, 0.0, 0.01, 0.04, workers=1) == pytest.approx(0.05)


def _simulated_kept_share(c, rate, full_every, batch_steps, lives=200_000):
    """Poisson failures simulated life by life (replay free: ``c.replay_s`` 0): each session
    spends restart + load + its base checkpoint's stall, then makes work durable chunk by chunk
    (a batch of B steps, durable its write time after it ends; without differentials F steps,
    durable the persist time after the full checkpoint); the share of the time that is kept."""
    x = np.random.default_rng(7).exponential(1 / rate, lives)
    e = evaluate(c, Limits(failure_rate_per_s=rate), full_every, batch_steps)
    step_s = c.step_s / (1 - e.overhead)                       # the model's step, fulls amortised
    if batch_steps is None:
        chunk_steps, latency_s = full_every, c.persist_s
    else:
        chunk_steps, latency_s = batch_steps, c.batch_write_s(batch_steps)
    before_s = c.restart_s + c.load_s + c.stall_s
    chunks = np.floor(np.maximum(x - before_s - latency_s, 0) / (chunk_steps * step_s)) * (x > before_s + latency_s)
    return float(np.sum(chunks) * chunk_steps * c.step_s / np.sum(x)), e


@pytest.mark.parametrize("full_every,batch_steps", [(20, None), (40, 4)])
def test_waste_is_exact_for_poisson_failures_when_they_come_often(full_every, batch_steps):
    """Failures every 20 s against a 3 s restart and a 10 s full interval (the real SIGKILL runs of
    experiments/tune_frequency.py): a session cut short loses what it ran, not a whole failure's
    cost. The first-order model (lost share = rate x cost of a failure) understated the goodput
    there by 12% (full-only) and 2.6% (differentials); the model now matches the simulation."""
    c = costs(step_s=0.5, stall_s=0.05, persist_s=0.5, replay_s=0.0, load_s=0.1, restart_s=3.0,
              batch_fixed_s=0.04, diff_bytes_per_step=2e7, write_bytes_per_s=1e9)
    rate = 1 / 20
    kept, e = _simulated_kept_share(c, rate, full_every, batch_steps)
    assert 1 - e.waste == pytest.approx(kept, rel=0.01)
    assert e.per_failure_s * rate == pytest.approx(1 - (1 - e.waste) / (1 - e.overhead))


def test_first_order_limit_is_the_cost_of_one_failure():
    """Rare failures: a failure costs restart + load + replay + the lost steps + the base
    checkpoint, as derived in docs/controller.md (Young's regime)."""
    c = costs()
    rare = Limits(failure_rate_per_s=1e-9)
    for full_every, batch_steps in ((100, None), (100, 4)):
        e = evaluate(c, rare, full_every, batch_steps)
        step_s = c.step_s / (1 - e.overhead)
        persist_s = c.shared_persist_s(batch_steps)
        if batch_steps is None:
            lost, replay = full_every / 2 + persist_s / step_s, 0.0
        else:
            lost = batch_steps / 2 + c.batch_write_s(batch_steps) / step_s
            replay = full_every / 2 + persist_s / step_s - lost
        expected = c.restart_s + c.load_s + c.replay_s * replay + step_s * lost + c.stall_s
        assert e.per_failure_s == pytest.approx(expected, rel=1e-6)
    # Never "no progress at all": the old cap (lost share 1 once rate x cost >= 1) is gone.
    assert evaluate(c, Limits(failure_rate_per_s=1 / 5), 100, None).waste < 1


def _simulated_kept_share_random_steps(c, rate, full_every, batch_steps, lives=80_000):
    """As _simulated_kept_share, step by step: each step's time is Gamma distributed with the
    model's mean step and variance ``c.step_var_s2`` (a chunk of n steps: their sum, Gamma with n
    times the shape); a failure keeps the chunks that became durable before it, and a session it
    cuts during restart + load + base checkpoint keeps nothing and starts again."""
    rng = np.random.default_rng(11)
    x = rng.exponential(1 / rate, lives)
    e = evaluate(c, Limits(failure_rate_per_s=rate), full_every, batch_steps)
    step_s = c.step_s / (1 - e.overhead)
    if batch_steps is None:
        chunk_steps, latency_s = full_every, c.persist_s
    else:
        chunk_steps, latency_s = batch_steps, c.batch_write_s(batch_steps)
    scale = c.step_var_s2 / step_s                                   # one step: shape step_s / scale
    most = int(12 / rate / (chunk_steps * step_s)) + 10              # more chunks than any life runs
    chunks = rng.gamma(chunk_steps * step_s / scale, scale, (lives, most))
    ends = np.cumsum(chunks, axis=1) + c.restart_s + c.load_s + c.stall_s + latency_s
    assert np.all(ends[:, -1] > x)
    kept_s = np.sum(chunks * (ends <= x[:, None]))
    return float(kept_s * c.step_s / step_s / np.sum(x)), e


@pytest.mark.parametrize("full_every,batch_steps", [(20, None), (40, 4)])
def test_a_failure_finds_a_long_step_in_progress_more_often(full_every, batch_steps):
    """Steps whose times vary (sd 1.5 times the mean, a loaded machine's worst in
    experiments/tune_frequency.py's real runs is 0.6): a failure lands in a long chunk more often
    than in a short one, so the chunk in progress loses var / (2 chunk) more than half a chunk.
    The model with the step variance matches a step-by-step simulation; without it (the model
    before step_var_s2), it is 2.1% (full-only) and 2.7% (differentials) high, outside the tolerance."""
    c = costs(step_s=0.5, stall_s=0.05, persist_s=0.5, replay_s=0.0, load_s=0.1, restart_s=3.0,
              batch_fixed_s=0.04, diff_bytes_per_step=2e7, write_bytes_per_s=1e9, step_var_s2=0.75 ** 2)
    rate = 1 / 20
    kept, e = _simulated_kept_share_random_steps(c, rate, full_every, batch_steps)
    assert 1 - e.waste == pytest.approx(kept, rel=0.006)
    deterministic = evaluate(dataclasses.replace(c, step_var_s2=0.0), Limits(failure_rate_per_s=rate),
                             full_every, batch_steps)
    assert (1 - deterministic.waste) / kept > 1.015
    # Rare failures: the first order, the chunk in progress length-biased.
    rare = Limits(failure_rate_per_s=1e-9)
    chunk_steps = full_every if batch_steps is None else batch_steps
    extra = evaluate(c, rare, full_every, batch_steps).per_failure_s - \
        evaluate(dataclasses.replace(c, step_var_s2=0.0), rare, full_every, batch_steps).per_failure_s
    step_s = c.step_s / (1 - e.overhead)
    assert extra == pytest.approx(chunk_steps * c.step_var_s2 / (2 * chunk_steps * step_s), rel=1e-4)


def test_without_the_step_variance_the_controller_sees_no_change():
    """step_var_s2 defaults to 0: the model (and so the controller, which does not measure it) is
    unchanged, bit for bit, where the input is not given."""
    c = costs()
    limits = Limits(failure_rate_per_s=1 / 3600)
    assert evaluate(c, limits, 100, 4) == evaluate(dataclasses.replace(c, step_var_s2=0.0), limits, 100, 4)
    assert solve(c, limits) == solve(dataclasses.replace(c, step_var_s2=0.0), limits)
