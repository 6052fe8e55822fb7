"""The scale model's pieces (experiments/scale_model.py): a rank's share of the storage, the
Young/Daly limit it reaches through the controller's cost model, the saturation accounting, the
per-day bookkeeping; and its validation against tune_frequency's real runs: their lives
(experiments/lifelog.py) and the inputs taken from them."""
import dataclasses
import json
import math

import numpy as np
import pytest

from experiments import lifelog
from experiments import scale_model as sm
from lowdiff.control.costmodel import Limits, evaluate

HOUR = 3600.0


def cluster(**changes):
    base = dict(name="test", gpus=1024, params=8e9, step_s=1.0, job_mtbf_s=10 * HOUR, shared_bytes_per_s=200e9,
                restart_s=300.0)
    return sm.Cluster(**{**base, **changes})


def strategy(name):
    return next(s for s in sm.STRATEGIES if s.name == name)


def test_a_rank_writes_its_share_at_its_share_of_the_bandwidth():
    c = cluster()
    m = sm.Measured(topk_ratio=0.01, index_bytes=2.0)
    dcp = sm.rank_costs(c, m, strategy("DCP-style async full"))
    # 8e9 params x 14 bytes over 1024 ranks, each at 1/1024 of 200 GB/s: the state over the bandwidth.
    assert dcp.full_bytes == pytest.approx(8e9 * 14 / 1024)
    assert dcp.persist_s == pytest.approx(8e9 * 14 / 200e9)
    assert dcp.load_s == pytest.approx(8e9 * 14 / 200e9)
    assert dcp.diff_bytes_per_step == 0 and dcp.record_s == 0
    sync = sm.rank_costs(c, m, strategy("sync full, Young/Daly"))
    assert sync.persist_s == 0 and sync.stall_s == pytest.approx(dcp.stall_s + dcp.persist_s)
    topk = sm.rank_costs(c, m, strategy("lowdiff TopK"))
    assert topk.diff_bytes_per_step == pytest.approx(8e9 * 0.01 * (4 + 2) / 1024)
    dense = sm.rank_costs(c, m, strategy("lowdiff Dense"))
    assert dense.diff_bytes_per_step == pytest.approx(8e9 * 4 / 1024)
    staged = sm.rank_costs(c, m, strategy("lowdiff TopK, staged"))
    assert staged.write_bytes_per_s == pytest.approx(10e9 / 8)        # the node's disk, shared by 8 GPUs
    # Durable only once drained: the local write and then the shared one.
    assert staged.persist_s == pytest.approx(dcp.full_bytes / (10e9 / 8) + dcp.persist_s)


def test_sync_full_checkpoints_reach_the_young_daly_limit():
    # A checkpoint cost delta far below the MTBF M: the interval is sqrt(2 delta M) and the waste
    # delta / T + (T / 2 + restart + load) / M to first order (Young 1974).
    c = cluster(shared_bytes_per_s=1e12, snapshot_bytes_per_s=1e12, job_mtbf_s=100 * HOUR, step_s=0.5)
    out = sm.assess(c, sm.Measured(), strategy("sync full, Young/Daly"))
    costs = sm.rank_costs(c, sm.Measured(), strategy("sync full, Young/Daly"))
    delta, mtbf = costs.stall_s, c.job_mtbf_s
    interval = math.sqrt(2 * delta * mtbf)
    assert out.full_every * c.step_s == pytest.approx(interval, rel=0.02)
    waste = delta / interval + (interval / 2 + c.restart_s + costs.load_s) / mtbf
    assert 1 - out.effective == pytest.approx(waste, rel=0.05)
    assert out.wait_s == 0   # synchronous writes are the stall already: nothing waits on top


def test_no_wait_while_the_storage_keeps_up():
    c = cluster()
    costs = sm.rank_costs(c, sm.Measured(), strategy("DCP-style async full"))
    e = evaluate(costs, Limits(failure_rate_per_s=1 / c.job_mtbf_s), 100, None)
    assert sm.saturation_wait_s(c, costs, e) == 0


def test_saturation_is_charged_as_the_time_the_storage_needs_beyond_the_interval():
    c = cluster(shared_bytes_per_s=20e9)
    costs = sm.rank_costs(c, sm.Measured(), strategy("lowdiff Dense, staged"))
    limits = Limits(failure_rate_per_s=1 / c.job_mtbf_s)
    e = evaluate(costs, limits, 10, 1)
    # Ten dense steps (32 GB each) and one full checkpoint (112 GB) at 20 GB/s: 21.6 s of the
    # fabric per interval, against ten steps of the (locally paced) training.
    fabric_s = (8e9 * 14 + 10 * 8e9 * 4) / 20e9
    interval_s = 10 * sm.base_step_s(costs, e) + costs.stall_s
    assert sm.saturation_wait_s(c, costs, e) == pytest.approx(fabric_s - interval_s)
    settled, charged, wait = sm.settle(c, costs, limits, 10, 1)
    assert wait == pytest.approx(fabric_s - interval_s, rel=1e-6)
    assert charged.stall_s == pytest.approx(costs.stall_s + wait)
    assert settled.waste > e.waste
    # Once paced, the job uses the fabric fully and no more.
    out = sm.assess(c, sm.Measured(), dataclasses.replace(strategy("lowdiff Dense, staged"), interval="controller"))
    assert out.wait_s > 0 and out.fabric_busy == pytest.approx(1.0, rel=0.02)


def test_full_only_settings_send_no_differentials():
    # "auto" may turn differentials off: then neither the traffic nor the saturation counts them.
    c = cluster(shared_bytes_per_s=20e9)
    auto = sm.assess(c, sm.Measured(), strategy("lowdiff Dense, auto"))
    dcp = sm.assess(c, sm.Measured(), strategy("DCP-style async full"))
    assert auto.batch_steps is None
    # Full checkpoints only: one state a full_every steps, steps at about the training's pace.
    full_per_step = 8e9 * 14 / auto.full_every
    assert auto.traffic_tb * 1e12 == pytest.approx(full_per_step * 86400 * auto.effective / c.step_s, rel=0.05)
    assert auto.wait_s == 0 and auto.effective >= dcp.effective - 1e-9


def test_a_day_adds_up():
    c = cluster(job_mtbf_s=2 * HOUR)
    for s in sm.STRATEGIES:
        out = sm.assess(c, sm.Measured(), s)
        day_h = 24 * out.effective + out.lost_h + out.recovery_h + out.stall_h
        assert day_h == pytest.approx(24, rel=0.02), s.name
        assert out.failures_per_day == pytest.approx(12, rel=0.01)


def test_a_failure_splits_into_recovery_and_lost_work():
    """A session cut short by the next failure spends less than a whole restart: recovery per
    failure is E[min(session, restart + load + replay + base)], and the work lost is never negative
    (with recovery charged whole, the exact model's smaller cost of a failure left it below 0)."""
    c = cluster(job_mtbf_s=0.5 * HOUR, restart_s=600.0)
    for s in sm.STRATEGIES:
        out = sm.assess(c, sm.Measured(), s)
        assert out.lost_h >= 0, s.name
        restart_h = out.failures_per_day * c.restart_s / HOUR
        # rate x restart = 1/3: a session gets through its restart (1 - e^(-1/3)) / (1/3) = 0.85 of it.
        assert out.recovery_h == pytest.approx(0.85 * restart_h, rel=0.02), s.name


def test_more_failures_or_less_bandwidth_never_help():
    base = cluster()
    for s in sm.STRATEGIES:
        e = [sm.assess(dataclasses.replace(base, job_mtbf_s=m * HOUR), sm.Measured(), s).effective for m in (1, 4, 16)]
        assert e[0] <= e[1] <= e[2], s.name
        if s.interval == "checkfreq":
            continue   # its own rule checkpoints more often the faster the storage: not an optimum
        b = [sm.assess(dataclasses.replace(base, shared_bytes_per_s=w), sm.Measured(), s).effective
             for w in (5e9, 50e9, 500e9)]
        assert b[0] <= b[1] + 1e-9 <= b[2] + 2e-9, s.name


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(ValueError, match="Cluster.gpus=0"):
        cluster(gpus=0)
    with pytest.raises(ValueError, match="sharding"):
        cluster(sharding="zero")
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"controller": {}}))
    with pytest.raises(ValueError, match=f"{path}: no measured costs"):
        sm.measured_from_stats(str(path))
    path.write_text(json.dumps({"controller": {"costs": {"step_s": 0.5, "record_s": 0.01, "batch_fixed_s": 0.004}}}))
    m = sm.measured_from_stats(str(path))
    assert m.record_frac == pytest.approx(0.02) and m.batch_fixed_s == pytest.approx(0.004)


# ------------------------------------------------------------------ the validation and its run's timeline

def test_stratified_lives_are_exponential_quantiles():
    lives = lifelog.stratified_lives(np.random.default_rng(3), 30.0, 240.0)
    assert len(lives) == 8
    # One life in each eighth of the exponential's distribution.
    strata = sorted(int(8 * -math.expm1(-x / 30.0)) for x in lives)
    assert strata == list(range(8))
    means = [np.mean(lifelog.stratified_lives(np.random.default_rng(s), 30.0, 240.0)) for s in range(4000)]
    assert np.mean(means) == pytest.approx(30.0, rel=0.02)


def write_timeline(path, lives):
    """A timeline as the driver and its trainers write it, with made-up times (a life given a
    sixth field: its kill's moment)."""
    with open(path, "w") as f:
        for start, end, resumed, steps, *kill in lives:
            f.write(f"life {start}\n")
            if resumed is not None:
                f.write("resumed {} {} {} {}\n".format(*resumed))
            for t, setting in steps:
                f.write(f"step {t} {setting}\n")
            if kill:
                f.write(f"kill {kill[0]}\n")
            f.write(f"end {end}\n")


def test_timeline_summary_is_what_the_run_spent(tmp_path):
    path = tmp_path / "t.timeline"
    write_timeline(path, [
        (0.0, 10.0, (3.0, 0.0, 0.0, 0), [(3.5, "10/1"), (4.0, "10/1"), (4.5, "10/1")]),   # fresh: nothing loaded
        (10.0, 12.0, None, []),                                                       # killed before resume
        (12.0, 30.0, (15.5, 0.2, 0.3, 6), [(16.5, "10/1"), (17.0, "10/1"), (17.5, "20/1")]),
    ])
    spent = lifelog.summarize(lifelog.read(str(path)))
    assert spent["lives"] == 3 and spent["wall_s"] == pytest.approx(30.0) and spent["short_lives"] == 1
    assert spent["step_s"] == pytest.approx(0.5) and spent["steps_run"] == 6
    assert spent["before_s"] == pytest.approx((3.0 + 4.0) / 2)
    assert spent["before_minus_resume_s"] == pytest.approx((3.0 + 3.5) / 2)
    assert spent["load_s"] == pytest.approx(0.2 / 2) and spent["replayed"] == 6   # of the lives that resumed
    assert spent["settings"] == {"10/1": 5, "20/1": 1}


def test_restarts_the_kills_cut_short_count_and_the_reaping_is_measured(tmp_path):
    """Kills cut the long restarts first: a mean over the lives that finished a step is too short.
    Here a life killed 9 s into a restart is at least 9 s long, which Kaplan-Meier counts (the
    lives that finished a step took 3 and 5 s). The moment of each kill splits a life's last
    moments into the step in progress (kill - last step end) and the reaping (kill to end)."""
    path = tmp_path / "t.timeline"
    write_timeline(path, [
        (0.0, 10.2, (2.0, 0.0, 0.0, 0), [(3.0, "4/1"), (3.5, "4/1"), (4.0, "4/1"), (5.0, "4/1")], 10.0),
        (10.2, 19.4, None, [], 19.2),                                        # cut short 9 s into its restart
        (19.4, 30.0, (23.0, 0.2, 0.3, 2), [(24.4, "4/1"), (24.9, "4/1"), (26.4, "4/1")], 29.6),
    ])
    spent = lifelog.summarize(lifelog.read(str(path)))
    gaps = np.array([0.5, 0.5, 1.0, 0.5, 1.5])
    assert spent["step_s"] == pytest.approx(0.8) and spent["step_var_s2"] == pytest.approx(np.var(gaps))
    # Kaplan-Meier over 3, 5 and >= 9: 3 + (5 - 3) * 2/3 + (9 - 5) * 1/3 = 5.667 (the curve ends at
    # the longest time seen), against 4 over the two that finished.
    assert spent["before_s"] == pytest.approx(3 + 2 * 2 / 3 + 4 / 3 - 0.8)
    assert spent["before_finished_s"] == pytest.approx(4.0 - 0.8)
    assert spent["before_minus_resume_s"] == pytest.approx(3 + (4.5 - 3) * 2 / 3 + (9 - 4.5) / 3 - 0.8)
    assert spent["before_minus_resume_finished_s"] == pytest.approx((3.0 + 4.5) / 2 - 0.8)
    assert spent["reap_s"] == pytest.approx((0.2 + 0.2 + 0.4) / 3)
    assert spent["in_progress_s"] == pytest.approx((5.0 + 3.2) / 2)
    # The validation's restart: the censored mean plus the reaping, less the base checkpoint's stall.
    costs = sm._from_the_run(sm.Costs(**IN_RUN), {**spent, "replayed": 2}, 4, 1)
    assert costs.restart_s == pytest.approx(spent["before_minus_resume_s"] + spent["reap_s"] - IN_RUN["stall_s"])
    assert costs.step_var_s2 == pytest.approx(np.var(gaps))
    assert sm._previous_inputs(costs, spent).restart_s == pytest.approx(3.75 - 0.8 - IN_RUN["stall_s"])


def test_censored_mean_is_kaplan_meier():
    assert lifelog.censored_mean([1.0, 2.0, 3.0], [True] * 3) == pytest.approx(2.0)
    # Exponential durations cut short by exponential censoring: the estimate finds the true mean
    # where the mean of the uncut ones is biased low.
    rng = np.random.default_rng(5)
    duration, cut = rng.exponential(4.0, 4000), rng.exponential(8.0, 4000)
    seen = duration <= cut
    assert lifelog.censored_mean(list(np.minimum(duration, cut)), list(seen)) == pytest.approx(4.0, rel=0.05)
    assert np.mean(duration[seen]) < 3.0


def test_a_damaged_timeline_is_named(tmp_path):
    path = tmp_path / "t.timeline"
    path.write_text("life 0.0\nstep x 10/1\n")
    with pytest.raises(ValueError, match=f"{path}, line 2: not a timeline event"):
        lifelog.read(str(path))
    path.write_text("life 0.0\nstep 1.0 10/1\n")
    with pytest.raises(ValueError, match="without its end"):
        lifelog.summarize(lifelog.read(str(path)))


def real_run(tmp_path, settings, in_run, spent, durable):
    row = {"round": 0, "settings": settings, "last_in_force": settings, "durable_steps": durable,
           "wall_s": spent["wall_s"], "kills": spent["lives"] - 1, "restart_s": in_run["restart_s"],
           "record_ratio": "nan", "goodput_steps_per_s": durable / spent["wall_s"],
           "in_run_costs": json.dumps(in_run), "timeline": json.dumps(spent)}
    sm.write_csv(str(tmp_path / "tune_real.csv"), [row])


IN_RUN = dict(step_s=0.2, stall_s=0.05, persist_s=0.5, replay_s=0.03, load_s=0.1, record_s=0.01, full_bytes=6e7,
              batch_fixed_s=0.04, diff_bytes_per_step=2e7, write_bytes_per_s=1e9, restart_s=2.0)


def test_validation_takes_the_step_time_of_the_whole_run(tmp_path):
    """The controller's step time is the median of the last 63 clean steps: in a run whose load
    changed it was 0.21 s where the run's mean step took 0.37 s, and the model missed by 62%. The
    validation takes the run's own mean step (and needs no measurement phase's file)."""
    spent = {"lives": 1, "wall_s": 1e7, "steps_run": 10**7, "step_s": 0.5, "before_s": 3.0,
             "before_minus_resume_s": 2.5, "load_s": 0.1, "replay_s": 0.0, "replayed": 0, "short_lives": 0,
             "settings": {"10/1": 10**7}}
    real_run(tmp_path, "10/1", IN_RUN, spent, durable=2 * 10**7 - 100)
    [row] = sm.validate(str(tmp_path))
    # Failures this rare cost nothing: the model's goodput is one step per mean step time.
    assert row["predicted_goodput"] == pytest.approx(1 / 0.5, rel=1e-4)
    assert row["ctl_costs"] == pytest.approx(1 / (0.2 + 0.01 + 0.05 / 10), rel=1e-4)
    assert row["restart_s"] == pytest.approx(2.5 - 0.05)      # the base checkpoint's stall is the model's
    assert sm.judged(row)


def test_validation_predicts_auto_at_the_settings_it_trained_with(tmp_path):
    spent = {"lives": 4, "wall_s": 120.0, "steps_run": 200, "step_s": 0.5, "before_s": 3.0,
             "before_minus_resume_s": 2.5, "load_s": 0.1, "replay_s": 0.8, "replayed": 20, "short_lives": 0,
             "settings": {"16/1": 30, "32/2": 170}}
    real_run(tmp_path, "auto", IN_RUN, spent, durable=150)
    [row] = sm.validate(str(tmp_path))
    assert row["in_force"] == "32/2" and row["in_force_share"] == pytest.approx(0.85)
    assert not sm.judged(row)          # shown, not counted: its settings changed for 15% of its steps
    costs = sm._from_the_run(sm.Costs(**IN_RUN), spent, 32, 2)
    assert costs.replay_s == pytest.approx(0.04) and costs.load_s == pytest.approx(0.1)   # the run's resumes
    e = evaluate(costs, Limits(failure_rate_per_s=4 / 120.0), 32, 2)
    assert row["predicted_goodput"] == pytest.approx((1 - e.waste) / costs.step_s)
    # The model's step with fulls amortised is the run's mean step.
    assert costs.step_s / (1 - e.overhead) == pytest.approx(0.5)


def test_validation_summarises_the_timeline_afresh_when_it_is_there(tmp_path):
    """The run's CSV keeps the summary lifelog made then; the timeline beside it is summarised as
    lifelog does now (a run made before the step variance existed is validated with it)."""
    spent = {"lives": 3, "wall_s": 30.0, "steps_run": 7, "step_s": 0.5, "before_s": 3.0,
             "before_minus_resume_s": 2.5, "load_s": 0.1, "replay_s": 0.0, "replayed": 0, "short_lives": 1,
             "settings": {"4/1": 7}}
    real_run(tmp_path, "4/1", IN_RUN, spent, durable=4)
    [saved] = sm.validate(str(tmp_path))
    assert saved["step_s"] == pytest.approx(0.5) and math.isnan(saved["reap_s"])
    write_timeline(tmp_path / "tune_real_round0-4_1.timeline", [
        (0.0, 10.2, (2.0, 0.0, 0.0, 0), [(3.0, "4/1"), (3.5, "4/1"), (4.0, "4/1"), (5.0, "4/1")], 10.0),
        (10.2, 19.4, None, [], 19.2),
        (19.4, 30.0, (23.0, 0.2, 0.3, 2), [(24.4, "4/1"), (24.9, "4/1"), (26.4, "4/1")], 29.6),
    ])
    [fresh] = sm.validate(str(tmp_path))
    assert fresh["step_s"] == pytest.approx(0.8) and fresh["reap_s"] == pytest.approx(0.8 / 3)
    assert fresh["step_sd_s"] == pytest.approx(np.std([0.5, 0.5, 1.0, 0.5, 1.5]))


def test_one_run_of_a_dozen_lives_scatters_most_with_long_chunks():
    """run_spread simulates the model's own session over runs of stratified lives: its mean is the
    model's goodput, and a run of 12 lives scatters by where its kills fall in the chunks, most
    with full checkpoints only every 20 steps (a kill loses up to 20 steps of a few hundred)."""
    c = sm.Costs(step_s=0.5, stall_s=0.05, persist_s=0.4, replay_s=0.04, load_s=0.15, restart_s=4.0,
                 batch_fixed_s=0.03, diff_bytes_per_step=2e7, write_bytes_per_s=1e9, step_var_s2=0.05)
    rate = 1 / 20
    spreads = {}
    for full_every, batch_steps in ((20, None), (10, 1)):
        e = evaluate(c, Limits(failure_rate_per_s=rate), full_every, batch_steps)
        mean, sd = sm.run_spread(e, rate, 12, 0.0, replicas=600)
        assert mean == pytest.approx((1 - e.waste) / c.step_s, rel=0.02)
        spreads[batch_steps] = sd / mean
    assert spreads[None] > 0.07 and spreads[1] < 0.06 and spreads[None] > 1.5 * spreads[1]
