"""The online controller: what it measures, that its decisions are the cost model's optimum, that
it changes settings only with hysteresis, and that fixed settings are left alone."""
import dataclasses
import json
import logging

import pytest

from lowdiff.control.controller import Controller
from lowdiff.control.costmodel import Evaluation, Limits, solve
from lowdiff.control.meter import process_age_s
from lowdiff.control.policy import (
    AUTO_INITIAL_BATCH_STEPS,
    AUTO_INITIAL_FULL_EVERY,
    LEARNING_FACTOR,
    LEARNING_FULL_COSTS,
    PROBE_MIN_FULL_EVERY,
    PROBE_WARMUP,
    RESOLVE_EVERY_BATCHES,
    choose,
)
from lowdiff.train.config import WrapConfig


def feed(controller, *, step_s=0.1, optimizer_s=0.01, record_s=0.0, stall_s=0.05, persist_s=0.5,
         full_bytes=500_000_000, batch_write_s=0.01, batch_bytes=1_000_000, batch_steps=None, batches=1,
         learned=True):
    """Samples as the three threads report them (medians of identical samples are the samples).
    ``learned``: past the learning phase (the cost of enough full checkpoints measured, as much as
    their stall; with differentials="auto", enough probes)."""
    w = controller._windows
    if learned and (controller.auto_full or controller.auto_batch):
        while len(w["full_cost_s"].samples) < LEARNING_FULL_COSTS:
            w["full_cost_s"].add(stall_s)
        if controller.auto_differentials:
            while len(w["record_ratio"].samples) < PROBE_WARMUP:
                w["record_ratio"].add(w["record_ratio"].value or 1.0)
    w["step_s"].add(step_s + record_s)   # the interval between step ends holds the recording
    w["optimizer_step_s"].add(optimizer_s)
    w["record_s"].add(record_s)
    controller.full_taken(stall_s)
    controller.full_persisted(persist_s, full_bytes)
    for _ in range(batches):
        controller.batch_written(batch_steps or controller.batch_steps, batch_write_s, batch_bytes)


def test_fixed_settings_are_kept_and_still_measured():
    controller = Controller(WrapConfig(full_every=7, batch_steps=3))
    feed(controller, persist_s=5.0)
    assert (controller.full_every, controller.batch_steps) == (7, 3)
    assert controller.history == []
    assert controller.costs().persist_s == 5.0
    assert controller.current.full_every == 7


def test_costs_are_derived_from_the_measurements():
    controller = Controller(WrapConfig(full_every=10, batch_steps=4))
    feed(controller, step_s=0.2, record_s=0.01, persist_s=0.5, full_bytes=500_000_000, batch_write_s=0.012,
         batch_bytes=2_000_000, batch_steps=4)
    c = controller.costs()
    assert c.step_s == pytest.approx(0.2) and c.record_s == pytest.approx(0.01)
    assert c.write_bytes_per_s == pytest.approx(1e9)          # the fastest write: the full, 500 MB in 0.5 s
    assert c.batch_fixed_s == pytest.approx(0.010)            # 12 ms minus 2 MB at 1 GB/s
    assert c.diff_bytes_per_step == pytest.approx(500_000)
    # Replay is a pipeline: the apply (the optimizer step, 10 ms) is slower than the read (0.5 ms,
    # no decode timed) its workers do alongside.
    assert c.replay_s == pytest.approx(0.01)
    assert c.load_s == pytest.approx(0.5)


def test_outliers_do_not_move_the_measurements():
    controller = Controller(WrapConfig(full_every=10, batch_steps=4))
    feed(controller, batches=9)
    controller.batch_written(4, 30.0, 1_000_000)   # one write stuck behind something else
    assert controller.costs().batch_fixed_s < 0.01


def test_auto_settings_are_the_cost_models_optimum_and_recorded():
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto", failure_rate_per_hour=1.0))
    feed(controller)
    best = solve(controller.costs(), controller.limits)
    assert (controller.full_every, controller.batch_steps) == (best.full_every, best.batch_steps)
    (decision,) = controller.history
    assert decision.reason.endswith("first decision") and decision.costs["stall_s"] == 0.05
    stats = controller.stats()["controller"]
    assert json.loads(json.dumps(stats))["history"][0]["full_every"] == best.full_every


def test_one_auto_setting_keeps_the_other_fixed():
    controller = Controller(WrapConfig(full_every=40, batch_steps="auto", failure_rate_per_hour=1.0))
    feed(controller, batch_write_s=0.3)
    assert controller.full_every == 40 and controller.batch_steps > 3


def test_decisions_are_logged_with_their_inputs(caplog):
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto"))
    with caplog.at_level(logging.INFO, logger="lowdiff"):
        feed(controller)
    (message,) = [r.getMessage() for r in caplog.records if "controller" in r.getMessage()]
    assert f"full_every {AUTO_INITIAL_FULL_EVERY} ->" in message and "stall_s=0.05" in message
    assert "first decision" in message


def _evaluation(full_every, waste, violated=()):
    return Evaluation(full_every, 4, waste, 0.0, 1.0, 1.0, violated)


@pytest.mark.parametrize("current,best,switch", [
    (_evaluation(100, 0.0100), _evaluation(120, 0.0098), False),    # 2% better: noise, keep
    (_evaluation(100, 0.0100), _evaluation(200, 0.0080), True),     # 20% better: switch
    (_evaluation(100, 0.00005), _evaluation(200, 0.00001), False),  # tiny in absolute terms
    (_evaluation(100, 0.0100, ("persist",)), _evaluation(101, 0.0100), True),  # broken constraint
    (_evaluation(100, 0.0100), _evaluation(100, 0.0050), False),    # same settings
])
def test_hysteresis(current, best, switch):
    assert (choose(current, best) is not None) == switch


def test_settings_change_only_when_the_costs_change_enough():
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto", failure_rate_per_hour=1.0))
    feed(controller)
    first = (controller.full_every, controller.batch_steps)
    feed(controller, stall_s=0.052, batches=RESOLVE_EVERY_BATCHES)  # a few % slower: kept
    assert (controller.full_every, controller.batch_steps) == first and len(controller.history) == 1
    for _ in range(40):                                              # stalls 10x longer: the median moves
        controller.full_taken(0.5)
    feed(controller, stall_s=0.5, batches=RESOLVE_EVERY_BATCHES)
    assert controller.full_every > first[0] and len(controller.history) == 2
    assert controller.history[1].previous_waste > controller.history[1].predicted_waste


def test_max_recovery_bound_is_passed_to_the_model():
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto", max_recovery_s=2.0))
    assert controller.limits == Limits(failure_rate_per_s=0.1 / 3600, max_recovery_s=2.0,
                                       batch_memory_bytes=256 * 2**20, max_pending_batches=2,
                                       max_full_every=100_000, max_batch_steps=256)
    feed(controller)
    assert controller.current.worst_recovery_s <= 2.0


@pytest.mark.parametrize("field,value", [("full_every", 0), ("batch_steps", "never"), ("max_pending_batches", 0),
                                         ("failure_rate_per_hour", 0.0), ("full_every", True),
                                         ("max_recovery_s", -1.0), ("batch_memory_bytes", 0)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        WrapConfig(**{field: value})


def test_a_full_checkpoint_is_charged_the_slowdown_of_the_steps_it_overlaps():
    """Steps that end while a full checkpoint is in flight take 0.15 s instead of 0.1 s; over a
    0.6 s persist (4 such steps) that is 0.2 s on top of the 0.05 s stall."""
    controller = Controller(WrapConfig(full_every=10, batch_steps=4))
    feed(controller, persist_s=0.6)
    controller._windows["busy_step_s"].add(0.15)
    assert controller.costs().stall_s == pytest.approx(0.05 + 0.05 * 0.6 / 0.15)


def test_tune_prints_the_recommendation_from_saved_stats(tmp_path, capsys):
    from lowdiff.cli import main as cli

    controller = Controller(WrapConfig(full_every=10, batch_steps=4))
    feed(controller)
    (tmp_path / "stats.json").write_text(json.dumps(controller.stats()))
    assert cli.main(["tune", "--stats", str(tmp_path / "stats.json"), "--failure-rate-per-hour", "1",
                     "--restart-s", "30"]) == 0
    out = capsys.readouterr().out
    best = solve(dataclasses.replace(controller.costs(), restart_s=30.0), Limits(failure_rate_per_s=1 / 3600))
    recommended = next(line for line in out.splitlines() if line.startswith("recommended")).split()
    assert recommended[1:3] == [str(best.full_every), str(best.batch_steps)]
    assert "Young/Daly" in out and "CheckFreq" in out


def test_tune_names_what_is_missing(capsys):
    from lowdiff.cli import main as cli

    assert cli.main(["tune", "--failure-rate-per-hour", "1", "--step-s", "0.1"]) == 2
    assert "stall_s" in capsys.readouterr().err


def test_a_measured_resume_replaces_the_estimates():
    """What recovery.resume measured (load, replay per record, the restart around them) is used
    instead of the estimates from sizes and bandwidth."""
    controller = Controller(WrapConfig(full_every=10, batch_steps=4))
    feed(controller)
    before = process_age_s()
    controller.resumed(load_s=0.3, replay_s=0.2, replayed=10)
    c = controller.costs()
    assert c.replay_s == pytest.approx(0.02) and c.load_s == pytest.approx(0.3)
    assert before - 0.5 <= c.restart_s <= process_age_s() - 0.5


def test_measurements_and_settings_outlive_the_process(tmp_path):
    """A new session of the directory starts from the measurements and settings of the last one
    (CONTROLLER.json), not from the initial guesses."""
    first = Controller(WrapConfig(full_every="auto", batch_steps="auto", failure_rate_per_hour=1.0))
    first.load_state(str(tmp_path))
    feed(first, stall_s=0.2, persist_s=3.0)
    first.resumed(load_s=0.4, replay_s=0.1, replayed=5)
    first.full_persisted(3.0, 500_000_000)          # writes CONTROLLER.json
    second = Controller(WrapConfig(full_every="auto", batch_steps="auto", failure_rate_per_hour=1.0))
    second.load_state(str(tmp_path))
    assert (second.full_every, second.batch_steps) == (first.full_every, first.batch_steps) != \
        (AUTO_INITIAL_FULL_EVERY, AUTO_INITIAL_BATCH_STEPS)
    assert second.costs() == first.costs()
    assert second.history[0].reason.startswith("settings and measurements of earlier sessions")
    fixed = Controller(WrapConfig(full_every=7, batch_steps=3))
    fixed.load_state(str(tmp_path))                 # measurements only: fixed settings stay, no decision
    assert (fixed.full_every, fixed.batch_steps, fixed.history) == (7, 3, []) and fixed.costs() == first.costs()


@pytest.mark.parametrize("content", [b"{not json", b'{"version": 99, "samples": {}, "settings": {}}',
                                     b'{"version": 1, "samples": {"step_s": ["fast"]}, "settings": {}}'])
def test_an_unusable_measurements_file_is_named_and_replaced(tmp_path, content):
    (tmp_path / "CONTROLLER.json").write_bytes(content)
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto"))
    with pytest.warns(RuntimeWarning, match="CONTROLLER.json"):
        controller.load_state(str(tmp_path))
    assert (controller.full_every, controller.batch_steps) == (AUTO_INITIAL_FULL_EVERY, AUTO_INITIAL_BATCH_STEPS)
    assert controller.costs() is None
    feed(controller)                                 # the next full checkpoint replaces it
    assert json.loads((tmp_path / "CONTROLLER.json").read_text())["version"] == 1


def expensive_recording(controller, **changes):
    """Recording costs 30% of a step (as a probe measured it); a full checkpoint stalls 2 ms:
    full-only wins by far."""
    for _ in range(PROBE_WARMUP):
        controller._windows["record_ratio"].add(1.3)
    feed(controller, **{"step_s": 0.1, "record_s": 0.03, "stall_s": 0.002, "persist_s": 0.05, **changes})


def test_differentials_are_turned_off_only_with_consent():
    kept = Controller(WrapConfig(full_every="auto", batch_steps="auto", failure_rate_per_hour=1.0))
    expensive_recording(kept)
    assert kept.differentials and kept.history[-1].batch_steps is not None
    auto = Controller(WrapConfig(full_every="auto", batch_steps="auto", failure_rate_per_hour=1.0,
                                 differentials="auto"))
    expensive_recording(auto)
    (decision,) = auto.history
    assert not auto.differentials and decision.batch_steps is None
    assert decision.predicted_waste == pytest.approx(
        solve(auto.costs(), auto.limits, differentials=False).waste)
    assert decision.predicted_waste < kept.history[-1].predicted_waste


def test_steps_without_differentials_measure_what_recording_costs():
    """Once steps without differentials are timed, recording is charged what steps with them take
    longer (the writer threads' share of the CPU included), not only the training thread's part."""
    controller = Controller(WrapConfig(full_every=10, batch_steps=4, differentials="auto"))
    feed(controller, step_s=0.1, record_s=0.01)       # intervals of 0.11 s with differentials
    controller._windows["bare_step_s"].add(0.08)
    c = controller.costs()
    assert c.step_s == pytest.approx(0.08) and c.record_s == pytest.approx(0.03)


def test_process_age_is_measured():
    age = process_age_s()
    assert age is not None and 0 < age < 24 * 3600


class FakeSession:
    """What lowdiff.persist.session does with the controller's switch, step by step, on a fake clock:
    differentials stop at once, start again only after a full checkpoint (the step that sees the
    change takes one). Steps take ``with_s`` recording (of which the training thread sees
    ``in_thread_s``), ``without_s`` not; a full checkpoint stalls ``stall_s``, slows the step
    after it by ``full_slowdown_s`` and persists at once; a batch of 4 records is written every 4
    recorded steps."""

    def __init__(self, controller, monkeypatch, with_s=0.13, without_s=0.10, in_thread_s=0.005, stall_s=0.0,
                 full_slowdown_s=0.0):
        self.controller, self.with_s, self.without_s = controller, with_s, without_s
        self.in_thread_s, self.stall_s, self.full_slowdown_s = in_thread_s, stall_s, full_slowdown_s
        self.now = 100.0
        monkeypatch.setattr("lowdiff.control.controller.time.perf_counter", lambda: self.now)
        self.recording = controller.differentials
        self.step, self.last_full, self.full_due, self.switch_on = 0, 0, False, False
        self.fulls, self.modes, self.recorded = [], [], 0

    def run(self, steps):
        c = self.controller
        for _ in range(steps):
            self.step += 1
            wanted = c.differentials
            if wanted and not self.recording:
                self.full_due = self.switch_on = True
            elif not wanted and self.recording:
                self.recording = False
            self.now += self.with_s if self.recording else self.without_s
            if self.fulls and self.fulls[-1] == self.step - 1:
                self.now += self.full_slowdown_s
            c.step_finished(0.01, self.recording)
            self.modes.append(self.recording)
            if self.recording:
                c.step_recorded(self.in_thread_s)
                self.recorded += 1
                if self.recorded % 4 == 0:
                    c.batch_written(4, 0.001, 100_000)
            if self.full_due or self.step - self.last_full >= c.full_every or self.step == 1:
                self.full_due, self.last_full = False, self.step
                self.fulls.append(self.step)
                if self.switch_on:
                    self.recording, self.switch_on = True, False
                self.now += self.stall_s
                c.full_taken(self.stall_s)
                c.full_persisted(0.0001, 1_000_000)


def test_the_probe_times_steps_without_differentials_before_full_checkpoints_due_anyway(monkeypatch):
    """With differentials="auto" and on, a probe now and then runs the few steps before a full
    checkpoint that is due anyway without recording: the cost model sees what recording really
    costs (4% of a step here, of which the training thread's own part is only 0.5 ms of 4), and no
    full checkpoint is added but the first probe's. (Failures every 10 s: differentials stay.)"""
    from lowdiff.control.policy import PROBE_EVERY_FULLS, PROBE_STEPS, PROBE_WARMUP

    controller = Controller(WrapConfig(full_every=40, batch_steps=4, differentials="auto",
                                       failure_rate_per_hour=360.0))
    session = FakeSession(controller, monkeypatch, with_s=0.104, in_thread_s=0.0005, stall_s=0.5)
    session.run(40 * (PROBE_WARMUP + 2 * PROBE_EVERY_FULLS))
    assert controller.differentials_wanted and len(controller.history) == 1
    assert controller.probes == PROBE_WARMUP + 2
    assert controller.stats()["controller"]["record_ratio"] == pytest.approx(1.04)
    c = controller.costs()
    assert c.record_s == pytest.approx(0.004) and c.step_s == pytest.approx(0.10)
    bare = [s + 1 for s, rec in enumerate(session.modes) if not rec]
    extra = [f for f, before in zip(session.fulls[1:], session.fulls) if f - before < 40]
    # The first probe: PROBE_STEPS clean recorded steps (the step after the base full at step 1
    # holds its stall), PROBE_STEPS without, then the switch-on step takes a full checkpoint.
    first_bare = 3 + PROBE_STEPS
    assert extra == [first_bare + PROBE_STEPS] and bare[:PROBE_STEPS + 1] == list(range(first_bare, extra[0] + 1))
    # Later probes: the PROBE_STEPS steps before a full checkpoint that was due, and the due one's.
    later = bare[PROBE_STEPS + 1:]
    assert len(later) == (controller.probes - 1) * (PROBE_STEPS + 1)
    assert all(s in session.fulls for s in later[PROBE_STEPS::PROBE_STEPS + 1])


def test_the_first_auto_decision_waits_for_the_first_probe(monkeypatch):
    """Recording costs 30% of a step, but the training thread sees only 5 ms of it: deciding
    before the probe would keep differentials for the wrong reason. After the first probe the
    first decision is taken, still with differentials (one probe is no ground to give up per-step
    durability) and an interval long enough for the next probes; once PROBE_WARMUP probes agree,
    full checkpoints only win."""
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto", differentials="auto",
                                       failure_rate_per_hour=1.0))
    session = FakeSession(controller, monkeypatch)
    session.run(6)
    assert controller.history == [] and controller.probes == 0
    while controller.probes < 1:
        session.run(1)
    session.run(2)
    (first,) = controller.history
    assert first.batch_steps is not None and controller.differentials_wanted
    assert first.full_every >= PROBE_MIN_FULL_EVERY and first.costs["record_s"] == pytest.approx(0.03)
    while controller.probes < PROBE_WARMUP:
        assert controller.differentials_wanted
        session.run(1)
    session.run(3 * PROBE_MIN_FULL_EVERY)
    off = [d for d in controller.history if d.batch_steps is None]
    assert off and not controller.differentials_wanted and off[0].steps_seen > first.steps_seen


def test_with_differentials_off_the_probe_records_a_few_steps_after_a_due_full(monkeypatch):
    """Off, the probe turns recording on at a full checkpoint that is due anyway (a chain starts
    there) and off again after PROBE_STEPS clean steps; the costs follow the machine: recording
    got cheaper (10%), and the ratio measured beside steps without shows it."""
    from lowdiff.control.policy import PROBE_STEPS

    controller = Controller(WrapConfig(full_every=30, batch_steps=4, differentials="auto"))
    controller.differentials = False
    controller._windows["record_ratio"].add(1.3)                 # an old probe: recording was dear
    session = FakeSession(controller, monkeypatch, with_s=0.11, without_s=0.10)
    session.run(30 * 12)
    assert controller.probes >= 2 and controller.stats()["controller"]["record_ratio"] == pytest.approx(1.1)
    on = [s + 1 for s, rec in enumerate(session.modes) if rec]
    assert on and all((s - 1) % 30 < 2 * PROBE_STEPS for s in on)   # only just after due full checkpoints
    assert all((f - 1) % 30 == 0 for f in session.fulls)            # no extra full checkpoint
    assert controller.costs().record_s == pytest.approx(0.01)


def test_full_checkpoints_every_step_are_charged_what_those_steps_take_longer(monkeypatch):
    """With a full checkpoint after every step, every step interval holds a stall: they are
    timed apart and the difference to a clean step is the full checkpoint's cost, not only the
    training thread's 1 ms stall (the copy's competition for the CPU is in the step)."""
    controller = Controller(WrapConfig(full_every=1, differentials=False))
    controller._windows["bare_step_s"].add(0.10)                  # clean steps, measured earlier
    session = FakeSession(controller, monkeypatch, without_s=0.16)
    session.run(20)
    assert controller.costs().stall_s == pytest.approx(0.06)


def test_a_full_checkpoint_is_charged_against_the_clean_steps_just_before_it(monkeypatch):
    """The step after a full checkpoint takes 50 ms longer (its copy and persist compete with it).
    The machine's load then doubles every step: medians of steps after full checkpoints (one
    sample per checkpoint, so a longer memory) against medians of clean steps would say the full
    checkpoints cost nothing; each one charged against the steps just before it costs 50 ms."""
    controller = Controller(WrapConfig(full_every=10, batch_steps=4))
    session = FakeSession(controller, monkeypatch, with_s=0.1, full_slowdown_s=0.05)
    session.run(200)
    session.with_s = 0.2
    session.run(70)
    assert controller._windows["full_step_s"].value == pytest.approx(0.15)   # mostly from before the change
    assert controller._windows["step_s"].value == pytest.approx(0.2)
    assert controller.costs().stall_s == pytest.approx(0.05)


def test_replay_per_record_is_fitted_apart_from_a_resumes_fixed_cost():
    """Resumes replaying 2 and 20 records took 0.5 s and 1.4 s: 0.05 s per record and 0.4 s set-up
    (charged with the load), not 0.25 s per record. A short resume alone is no measure of a record."""
    controller = Controller(WrapConfig(full_every=10, batch_steps=4))
    feed(controller, optimizer_s=0.01)
    controller.resumed(load_s=0.3, replay_s=0.5, replayed=2)
    assert controller.costs().replay_s == pytest.approx(0.01)      # still the estimate (the apply)
    controller.resumed(load_s=0.3, replay_s=1.4, replayed=20)
    c = controller.costs()
    assert c.replay_s == pytest.approx(0.05) and c.load_s == pytest.approx(0.3 + 0.4)


def test_the_initial_guess_measures_everything_soon_and_fits_any_memory_budget():
    """Before anything is measured: one record per write (the least memory held and work lost; a
    batch write timed after the first recorded step) and the shortest interval the probe can run
    in (a full checkpoint's cost measured within the first interval)."""
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto", differentials="auto"))
    assert controller.batch_steps == 1 and controller.full_every == PROBE_MIN_FULL_EVERY
    assert controller.limits.max_pending_batches * controller.batch_steps * 100e6 < controller.limits.batch_memory_bytes


def test_learning_moves_each_setting_at_most_a_factor_per_measured_full_checkpoint():
    """A full checkpoint measured once at 0.7 ms makes F=4 the optimum (at 1 ms F is 4 or 5, a
    near tie, 5 in the model exact for Poisson failures): until LEARNING_FULL_COSTS
    full checkpoints are measured, each decision moves F at most a factor LEARNING_FACTOR from
    the settings in force, and only after a new measured full checkpoint; then it moves freely."""
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto", failure_rate_per_hour=360.0))
    cheap = dict(stall_s=0.0007, persist_s=0.01, full_bytes=10_000_000, learned=False)
    feed(controller, **cheap)
    optimum = solve(controller.costs(), controller.limits)
    assert optimum.full_every <= AUTO_INITIAL_FULL_EVERY // LEARNING_FACTOR**2
    (first,) = controller.history
    assert first.full_every == AUTO_INITIAL_FULL_EVERY // LEARNING_FACTOR and "learning" in first.reason
    assert first.batch_steps <= AUTO_INITIAL_BATCH_STEPS * LEARNING_FACTOR
    for _ in range(2 * RESOLVE_EVERY_BATCHES):                      # no new full checkpoint measured: kept
        controller.batch_written(1, 0.01, 1_000_000)
    assert len(controller.history) == 1
    settings = [controller.full_every]
    while len(controller._windows["full_cost_s"].samples) < LEARNING_FULL_COSTS:
        feed(controller, **cheap)                                    # (charges the full checkpoint before)
        settings.append(controller.full_every)
    assert settings[1] == AUTO_INITIAL_FULL_EVERY // LEARNING_FACTOR**2
    assert all(a <= b * LEARNING_FACTOR for a, b in zip(settings, settings[1:]))
    assert controller.full_every == solve(controller.costs(), controller.limits).full_every


def test_learning_does_not_hold_settings_that_break_a_constraint():
    """A persist of 10 s at 0.1 s per step needs F >= 100 (the pipeline constraint, from a write
    time, not from a full checkpoint's cost): the first decision goes there at once."""
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto", failure_rate_per_hour=1.0))
    feed(controller, persist_s=10.0, learned=False)
    assert controller.full_every >= 100 and not controller.current.violated


def test_a_decision_is_kept_in_the_measurements_file_at_once(tmp_path):
    """A decision taken at a batch write is in CONTROLLER.json right away: a SIGKILL before the
    next full checkpoint does not make the restarted session learn it again."""
    controller = Controller(WrapConfig(full_every="auto", batch_steps="auto", failure_rate_per_hour=1.0))
    controller.load_state(str(tmp_path))
    for name in ("step_s", "optimizer_step_s", "record_s"):
        controller._windows[name].add(0.1 if name == "step_s" else 0.0)
    for _ in range(LEARNING_FULL_COSTS):
        controller._windows["full_cost_s"].add(0.05)
    controller.full_taken(0.05)
    controller.full_persisted(0.5, 500_000_000)      # no decision yet: batch writes not measured
    assert controller.history == []
    controller.batch_written(1, 0.01, 1_000_000)
    (decision,) = controller.history
    kept = json.loads((tmp_path / "CONTROLLER.json").read_text())["settings"]
    assert (kept["full_every"], kept["batch_steps"]) == (decision.full_every, decision.batch_steps) != \
        (AUTO_INITIAL_FULL_EVERY, AUTO_INITIAL_BATCH_STEPS)
    assert kept == {"full_every": controller.full_every, "batch_steps": controller.batch_steps, "differentials": True}


def test_a_probes_sample_is_kept_in_the_measurements_file_at_the_next_batch(tmp_path):
    """A probe costs a few unrecorded steps: its sample is written to CONTROLLER.json by the diff
    writer at the next batch, not only at the next full checkpoint (a SIGKILL before it would
    make the restarted session probe again)."""
    from lowdiff.control.policy import Probe

    controller = Controller(WrapConfig(full_every=40, batch_steps=4, differentials="auto"))
    controller.load_state(str(tmp_path))
    feed(controller)
    controller.policy.probe = Probe(False, [0.11, 0.11], 0, samples=[0.1, 0.1], steps=2)
    controller._end_probe_locked()
    assert json.loads((tmp_path / "CONTROLLER.json").read_text())["samples"].get("record_ratio") is None
    controller.batch_written(4, 0.01, 1_000_000)
    kept = json.loads((tmp_path / "CONTROLLER.json").read_text())["samples"]["record_ratio"]
    assert kept == [pytest.approx(1.1)]
