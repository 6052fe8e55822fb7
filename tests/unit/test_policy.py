"""The controller's two parts on their own: the policy driven directly, step by step, with explicit
inputs (no meter, no clock, no lock: as experiments/tune_frequency.py drives it), and the cost meter
as three threads report to it."""
import ast
import pathlib
import threading

import pytest

import lowdiff.control.policy as policy_module
from lowdiff.control.costmodel import Costs, Limits, evaluate, solve
from lowdiff.control.meter import CostMeter
from lowdiff.control.policy import (
    AUTO_INITIAL_BATCH_STEPS,
    AUTO_INITIAL_FULL_EVERY,
    LEARNING_FACTOR,
    LEARNING_FULL_COSTS,
    PROBE_STEPS,
    PROBE_WARMUP,
    RESOLVE_EVERY_BATCHES,
    Measured,
    Policy,
)

LIMITS = Limits(failure_rate_per_s=1 / 3600)


def costs(**changes):
    base = dict(step_s=0.1, stall_s=0.05, persist_s=0.5, replay_s=0.01, load_s=0.5, record_s=0.0, full_bytes=5e8,
                batch_fixed_s=0.01, diff_bytes_per_step=1e6, write_bytes_per_s=1e9, restart_s=0.0)
    return Costs(**{**base, **changes})


def learned(c, **changes):
    return Measured(c, **{"differentials_measured": True, "full_costs": LEARNING_FULL_COSTS,
                          "probes": PROBE_WARMUP, **changes})


def auto_policy(differentials=True, limits=LIMITS):
    return Policy(limits, full_every="auto", batch_steps="auto", differentials=differentials)


def test_the_policy_imports_no_clock_lock_or_io():
    tree = ast.parse(pathlib.Path(policy_module.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "collections", "dataclasses", "statistics", "typing",
                        "lowdiff.control.costmodel"}


@pytest.mark.parametrize("differentials", [True, "auto"])
def test_once_learned_the_first_decision_is_the_cost_models_optimum(differentials):
    c = costs()
    policy = auto_policy(differentials)
    assert (policy.full_every, policy.batch_steps) == (AUTO_INITIAL_FULL_EVERY, AUTO_INITIAL_BATCH_STEPS)
    change = policy.resolve(learned(c), "test", time_s=1.5)
    best = solve(c, LIMITS, differentials=differentials)
    assert policy.current == best and (policy.full_every, policy.batch_steps) == (best.full_every, best.batch_steps)
    assert change.decision is policy.history[-1] and change.decision.time_s == 1.5
    assert change.decision.reason == "test: first decision" and change.decision.costs["stall_s"] == 0.05
    assert change.replaced == evaluate(c, LIMITS, AUTO_INITIAL_FULL_EVERY, AUTO_INITIAL_BATCH_STEPS)


def test_fixed_settings_are_only_evaluated():
    policy = Policy(LIMITS, full_every=7, batch_steps=3, differentials=True)
    assert policy.resolve(learned(costs()), "test", time_s=0.0) is None
    assert policy.current == evaluate(costs(), LIMITS, 7, 3) and policy.history == []


def test_nothing_is_decided_before_the_costs_in_force_are_measured():
    policy = auto_policy()
    assert policy.resolve(learned(None), "test", time_s=0.0) is None
    assert policy.resolve(learned(costs(), differentials_measured=False), "test", time_s=0.0) is None
    assert policy.current is None and policy.history == []


def test_learning_moves_a_factor_per_new_full_checkpoint_cost():
    """A cheap full checkpoint makes a short interval the optimum: with one cost measured, the
    first decision halves F; the same evidence again decides nothing; each new sample halves it
    again; once LEARNING_FULL_COSTS are in, the optimum is taken."""
    # (0.7 ms: F* = 4; at 1 ms F* is 4 or 5, a near tie, 5 in the model exact for Poisson failures.)
    c = costs(stall_s=0.0007, persist_s=0.01, full_bytes=1e7, load_s=0.01, diff_bytes_per_step=1e5, batch_fixed_s=0.001)
    optimum = solve(c, Limits(failure_rate_per_s=0.1)).full_every
    policy = auto_policy(limits=Limits(failure_rate_per_s=0.1))
    assert optimum <= AUTO_INITIAL_FULL_EVERY // LEARNING_FACTOR ** 2
    intervals = []
    for full_costs in range(1, LEARNING_FULL_COSTS + 1):
        for _ in range(2):   # the second time: no new sample, no decision
            policy.resolve(learned(c, full_costs=full_costs), "test", time_s=0.0)
        intervals.append(policy.full_every)
    halved = AUTO_INITIAL_FULL_EVERY // LEARNING_FACTOR
    assert intervals[:2] == [halved, halved // LEARNING_FACTOR]
    assert intervals[-1] == optimum and len(policy.history) == len(set(intervals))
    assert "learning" in policy.history[0].reason


def test_hysteresis_keeps_settings_for_small_changes():
    policy = auto_policy()
    policy.resolve(learned(costs()), "test", time_s=0.0)
    first = (policy.full_every, policy.batch_steps)
    assert policy.resolve(learned(costs(stall_s=0.052)), "test", time_s=1.0) is None
    assert (policy.full_every, policy.batch_steps) == first
    change = policy.resolve(learned(costs(stall_s=0.5)), "test", time_s=2.0)
    assert change is not None and policy.full_every > first[0]
    assert change.replaced.full_every == first[0] and change.decision.previous_waste == change.replaced.waste


def test_batches_make_a_decision_due_every_few():
    policy = auto_policy()
    assert policy.batch_written()                     # before the first decision: at every batch
    policy.resolve(learned(costs()), "test", time_s=0.0)
    due = [policy.batch_written() for _ in range(2 * RESOLVE_EVERY_BATCHES)]
    assert due.index(True) == RESOLVE_EVERY_BATCHES - 1


def test_a_probe_driven_step_by_step_times_steps_without_differentials():
    """The first probe runs once PROBE_STEPS clean recorded steps are seen: the next PROBE_STEPS
    steps record nothing; their median against the ones before is one ratio sample."""
    policy = Policy(LIMITS, full_every=40, batch_steps=4, differentials="auto")
    assert policy.full_taken() is None
    modes, samples = [], []
    for _ in range(3 * PROBE_STEPS):
        recording = policy.differentials
        modes.append(recording)
        sample = policy.step_finished(recording, 0.11 if recording else 0.10, probes=len(samples))
        if sample is not None:
            samples.append(sample)
    assert modes == [True] * PROBE_STEPS + [False] * PROBE_STEPS + [True] * PROBE_STEPS
    assert samples == [pytest.approx(1.1)] and policy.probes == 1 and policy.differentials_wanted


def test_adopted_settings_are_the_first_decision():
    policy = auto_policy()
    policy.adopt({"full_every": 64, "batch_steps": 8, "differentials": False})   # differentials not "auto"
    assert (policy.full_every, policy.batch_steps, policy.differentials_wanted) == (64, 8, True)
    policy.adopt({"full_every": 0, "batch_steps": True})                        # not sensible: ignored
    first = policy.continue_from(learned(costs()), "earlier")
    assert first is policy.history[0] and (first.full_every, first.batch_steps, first.reason) == (64, 8, "earlier")
    assert policy.settings() == {"full_every": 64, "batch_steps": 8, "differentials": True}


def test_the_meter_counts_every_report_of_concurrent_threads():
    meter = CostMeter()
    reports = 800                       # (fewer than the raw samples kept)

    def training():
        for i in range(reports):
            meter.step_finished(float(i), 0.01, True)
            meter.step_recorded(0.001)

    def writer():
        for _ in range(reports):
            meter.batch_written(4, 0.01, 1_000_000)

    threads = [threading.Thread(target=training), threading.Thread(target=writer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(meter.samples["batch_write_s"]) == reports
    assert meter.value("step_s") == 1.0 and meter.count("record_s") == 63
    meter.full_taken(0.05, differentials=True)
    meter.full_persisted(0.5, 500_000_000)
    measured = meter.measured(differentials=True)
    assert measured.differentials_measured and measured.costs.stall_s == pytest.approx(0.05)
    assert (measured.full_costs, measured.probes) == (0, 0)


def test_the_meter_keeps_its_samples_between_sessions(tmp_path):
    meter = CostMeter()
    meter.add("record_ratio", 1.25)
    meter.full_taken(0.05, differentials=True)
    meter.save(str(tmp_path), {"full_every": 9, "batch_steps": 2, "differentials": True})
    again = CostMeter()
    assert again.load(str(tmp_path)) == {"full_every": 9, "batch_steps": 2, "differentials": True}
    assert again.value("record_ratio") == 1.25 and again.value("stall_s") == 0.05
    assert CostMeter().load(str(tmp_path / "nothing-here")) is None
