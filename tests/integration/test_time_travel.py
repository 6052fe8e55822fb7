"""Time travel: ``recovery.resume(..., step=K)`` restores the state after any retained step K
exactly, says what it did (the structured result), refuses a K that is not retained naming what
is, and training on from K reproduces the uninterrupted run.
"""
from __future__ import annotations

import logging

import pytest
from lowdiff_helpers import build, reference_digests, resumed_digest, train_directory, train_steps, wrap

import lowdiff
import recovery
from lowdiff.cli.demo import state_digest
from lowdiff.store.manifest import read_manifest

STEPS = 23   # lowdiff_helpers: full_every 6, batch_steps 3, keep_full 4: fulls 0, 6, 12, 18


@pytest.fixture(scope="module")
def reference():
    return reference_digests(STEPS + 4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    return train_directory(str(tmp_path_factory.mktemp("travel") / "ckpt"), STEPS)


@pytest.mark.parametrize("step", [7, 9, 10, 12, 13, 17, 18, STEPS, None])
def test_resume_at_any_retained_step_is_exact(trained, reference, step):
    """The first step after a full checkpoint (7, 13), the last step of a batch (9), a step inside a
    batch (10, 17), a full checkpoint's own step (12, 18), the newest (23 and None)."""
    result, digest = resumed_digest(trained, step)
    want = STEPS if step is None else step
    assert result == want and digest == reference[want]
    full = max(s for s in (0, 6, 12, 18) if s <= want)
    assert result.full_step == full and result.replayed == want - full
    assert result.full_file.startswith(f"full-{full:012d}-")
    assert result.skipped == ()
    assert min(result.read_s, result.decode_s, result.apply_s) >= 0


def test_a_step_that_is_not_retained_is_refused_naming_what_is(trained):
    with pytest.raises(lowdiff.NoCheckpointError, match=r"step 40 is not retained; retained steps: 0\.\.23"):
        resumed_digest(trained, 40)
    with pytest.raises(ValueError, match="step"):
        resumed_digest(trained, -1)


def test_training_on_after_time_travel_reproduces_the_run_and_abandons_the_newer_steps(tmp_path, reference, caplog):
    directory = str(tmp_path / "ckpt")
    model, opt, sched, sampler = build()
    opt = wrap(directory, model, opt, sched, sampler)
    recovery.resume(directory, model, opt)
    train_steps(model, opt, sched, sampler, 0, STEPS)
    opt.close()

    model, opt, sched, sampler = build()
    opt = wrap(directory, model, opt, sched, sampler)
    try:
        with caplog.at_level(logging.WARNING, logger="lowdiff"):
            start = recovery.resume(directory, model, opt, step=10)
        assert start == 10
        assert any("abandon" in r.getMessage() and "11..23" in r.getMessage() for r in caplog.records)
        seen = {}
        train_steps(model, opt, sched, sampler, 10, 15,
                    lambda s: seen.setdefault(s, state_digest(model, opt, sched, sampler)))
        assert seen == {s: reference[s] for s in range(11, 16)}
    finally:
        opt.close()
    assert read_manifest(directory).durable_step() == 15
    result, digest = resumed_digest(directory, None)
    assert (result, digest) == (15, reference[15])
