"""differentials=False / "auto": full checkpoints only, or differentials switched off and on as the
controller decides. Training is unchanged (TopK still sparsifies what the optimizer consumes),
every step that is durable resumes exactly, flush() and close() make the newest step durable, and
measurements are kept in CONTROLLER.json for the next session."""
import json

import pytest
from lowdiff_helpers import BATCH_STEPS, FULL_EVERY, build, reference_digests, train_steps, wrap

import lowdiff
import recovery
from lowdiff.errors import NoCheckpointError

STEPS = 30


def _resume(directory, step=None):
    from lowdiff.cli.demo import state_digest

    model, opt, sched, sampler = build()
    got = recovery.resume(str(directory), model, opt, step=step, scheduler=sched, extra_state={"sampler": sampler})
    return int(got), state_digest(model, opt, sched, sampler)


def test_switching_differentials_off_and_on_keeps_training_and_resume_exact(tmp_path, rng):
    """The controller's switch is flipped every few steps (as its decisions would, from another
    thread): steps recorded while on, and full checkpoints, resume exactly; the others are not
    retained (and say so); the run itself equals the uninterrupted run without lowdiff."""
    reference = reference_digests(STEPS)
    directory = tmp_path / "ckpt"
    model, opt, sched, sampler = build()
    opt = wrap(str(directory), model, opt, sched, sampler, retention=lowdiff.KeepLast(100),
               schedule=lowdiff.Auto(full_every=FULL_EVERY, batch_steps=BATCH_STEPS, differentials="auto"))
    modes, durable = {}, set()

    def flip(step):
        modes[step] = opt._session.recording
        durable.update(range(opt._session._last_full_step, step + 1) if modes[step] else [opt._session._last_full_step])
        if step % 4 == 0:
            opt.controller.differentials = bool(rng.integers(0, 2))
            opt.controller.full_every = int(rng.integers(3, 8))

    try:
        train_steps(model, opt, sched, sampler, 0, STEPS, flip)
        assert opt.stats()["differentials"] == modes[STEPS]
        opt.flush()
    finally:
        opt.close()
    assert True in modes.values() and False in modes.values()
    # The durable steps around every switch, and a sample of the others (each resume costs ~0.3 s).
    switches = {s for s in modes if s + 1 in modes and modes[s] != modes[s + 1]}
    around = {s + d for s in switches for d in (-1, 0, 1, 2)} & durable
    sample = around | set(rng.choice(sorted(durable), size=min(6, len(durable)), replace=False).tolist()) | {STEPS}
    for step in sorted(sample):
        assert _resume(directory, step) == (step, reference[step]), f"step {step} (modes {modes})"
    skipped = [s for s in range(STEPS) if s not in durable]
    assert skipped, modes
    with pytest.raises(NoCheckpointError):
        _resume(directory, skipped[0])


def test_full_only_flush_and_close_make_the_newest_step_durable(tmp_path):
    reference = reference_digests(13)
    directory = tmp_path / "ckpt"
    model, opt, sched, sampler = build()
    opt = wrap(str(directory), model, opt, sched, sampler,
               schedule=lowdiff.Fixed(full_every=5, batch_steps=BATCH_STEPS, differentials=False))
    queued = []   # what the differential writer is handed: nothing to seal, so not even a wake-up
    hand_over = opt._session.diffs._queue.put
    opt._session.diffs._queue.put = lambda item: (queued.append(item), hand_over(item))[1]
    train_steps(model, opt, sched, sampler, 0, 7)
    assert opt.durable_step < 7 and not opt.stats()["differentials"]
    assert opt.stats()["full_persist_count"] and queued == []
    opt.flush()
    assert opt.durable_step == 7
    train_steps(model, opt, sched, sampler, 7, 13)
    opt.close()
    assert not [f for f in (directory).iterdir() if f.suffix == ".ldd"]   # no differential written
    assert _resume(directory) == (13, reference[13])
    assert _resume(directory, 12) == (12, reference[12])   # full_every counts from the flush at 7
    state = json.loads((directory / "CONTROLLER.json").read_text())
    assert state["settings"]["differentials"] is False and state["samples"]["bare_step_s"]


def test_a_new_session_starts_from_the_last_ones_measurements(tmp_path):
    """With everything auto, a resumed session starts with the settings and costs the previous one
    kept, and its resume (load, replay, restart) is measured."""
    directory = tmp_path / "ckpt"
    model, opt, sched, sampler = build()
    opt = wrap(str(directory), model, opt, sched, sampler,
               schedule=lowdiff.Auto(differentials="auto", failure_rate_per_hour=3.6e4))
    recovery.resume(str(directory), model, opt)
    train_steps(model, opt, sched, sampler, 0, 20)
    opt.close()
    kept = json.loads((directory / "CONTROLLER.json").read_text())
    assert kept["samples"]["restart_s"] and kept["samples"]["persist_s"]

    model, opt, sched, sampler = build()
    opt = wrap(str(directory), model, opt, sched, sampler,
               schedule=lowdiff.Auto(differentials="auto", failure_rate_per_hour=3.6e4))
    try:
        first = opt.controller.history[0]
        assert "earlier sessions" in first.reason
        assert (first.full_every, first.batch_steps is not None) == (kept["settings"]["full_every"],
                                                                    kept["settings"]["differentials"])
        start = recovery.resume(str(directory), model, opt)
        assert start == 20
        assert len(opt.controller._windows["restart_s"].samples) == len(kept["samples"]["restart_s"]) + 1
    finally:
        opt.close()


def test_probes_of_what_recording_costs_keep_every_durable_step_exact(tmp_path, rng):
    """differentials="auto" probes what recording costs: now and then a few steps record nothing
    before a full checkpoint (the batch before them sealed; the full checkpoint restarts the chain),
    or, with differentials off, record the few steps after one. The steps it leaves unrecorded are
    durable only through that full checkpoint; every durable step resumes exactly."""
    import time

    from lowdiff.control.controller import PROBE_MIN_FULL_EVERY

    steps = 3 * PROBE_MIN_FULL_EVERY
    reference = reference_digests(steps)
    directory = tmp_path / "ckpt"
    model, opt, sched, sampler = build()
    opt = wrap(str(directory), model, opt, sched, sampler, retention=lowdiff.KeepLast(100),
               schedule=lowdiff.Auto(full_every=PROBE_MIN_FULL_EVERY, batch_steps=4, differentials="auto"))
    modes, wanted, durable = {}, {}, set()

    def note(step):
        modes[step], wanted[step] = opt._session.recording, opt.controller.differentials_wanted
        durable.update(range(opt._session._last_full_step, step + 1) if modes[step] else [opt._session._last_full_step])
        time.sleep(0.03)   # steps long enough that full checkpoints persist between them (clean steps)

    try:
        train_steps(model, opt, sched, sampler, 0, steps, note)
        assert opt.controller.probes >= 1
        opt.flush()
    finally:
        opt.close()
    probed = [s for s in modes if modes[s] != wanted[s]]   # steps doing the opposite of the setting in force
    assert probed, (modes, wanted)
    around = {s + d for s in probed for d in (-2, -1, 0, 1, 2)} & durable
    sample = around | set(rng.choice(sorted(durable), size=min(4, len(durable)), replace=False).tolist()) | {steps}
    for step in sorted(sample):
        assert _resume(directory, step) == (step, reference[step]), f"step {step} (modes {modes})"
    unrecorded = [s for s in probed if s not in durable]
    if unrecorded:
        with pytest.raises(NoCheckpointError):
            _resume(directory, unrecorded[0])
