"""Recovery plans before it changes anything (recovery.plan, recovery.execute): a target step that
cannot be reached is refused with the live model's parameters and the optimizer's state untouched,
byte for byte; the plan is frozen and lists the full checkpoints in the order recovery falls back
in; a record that fails to verify in the middle of the replay still ends in the same refusal.
"""
from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch
from lowdiff_helpers import build, reference_digests, resumed_digest, train_directory

import lowdiff
import recovery
from lowdiff.format.batchfile import BatchReader
from recovery.plan import Plan
from recovery.restore import plan_directory

STEPS = 23   # lowdiff_helpers: full_every 6, batch_steps 3, keep_full 4: fulls 0, 6, 12, 18


@pytest.fixture(scope="module")
def reference():
    return reference_digests(STEPS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    return train_directory(str(tmp_path_factory.mktemp("plan") / "ckpt"), STEPS)


@pytest.fixture
def ckpt(trained, tmp_path) -> str:
    """A copy of the trained directory that a test may damage."""
    directory = str(tmp_path / "ckpt")
    shutil.copytree(trained, directory)
    return directory


def stepped_objects():
    """Live objects whose optimizer has state (so a full checkpoint would be read into it too)."""
    model, opt, sched, sampler = build()
    model(torch.randn(8, 32)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt, sched, sampler


def live_bytes(model, opt) -> list:
    """Every byte of the model's parameters and buffers and of the optimizer's state."""
    out = [(key, value.detach().cpu().numpy().tobytes()) for key, value in model.state_dict().items()]
    for index, state in sorted(opt.state_dict()["state"].items()):
        for name, value in sorted(state.items()):
            out.append((f"{index}/{name}", value.cpu().numpy().tobytes() if hasattr(value, "numpy") else value))
    return out


def refused_untouched(directory, step, match):
    model, opt, sched, sampler = stepped_objects()
    before = live_bytes(model, opt)
    with pytest.raises(lowdiff.NoCheckpointError, match=match):
        recovery.resume(directory, model, opt, scheduler=sched, extra_state={"sampler": sampler}, step=step)
    assert live_bytes(model, opt) == before


def batch_file(directory, first: int) -> str:
    return named(directory, f"diff-{first:012d}-")


def named(directory, prefix: str) -> str:
    return next(os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.startswith(prefix))


def flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_step_that_is_not_retained_is_refused_before_anything_changes(trained):
    refused_untouched(trained, 40, r"step 40 is not retained; retained steps: 0\.\.23")


def test_a_step_beyond_a_chain_whose_file_fails_is_refused_before_anything_changes(ckpt, reference):
    """The batch of steps 13..15 is not a lowdiff file: the full checkpoint of step 12 is the one a
    resume at step 14 starts from, and its chain ends at 12. Refused (the same words as when the
    full checkpoint was read first) before a byte of it reaches the live objects."""
    flip(batch_file(ckpt, 13), 0)
    refused_untouched(ckpt, 14, r"step 14 cannot be rebuilt: the files after the full checkpoint of step 12 "
                                r"reach only step 12")
    result, digest = resumed_digest(ckpt, 12)   # what the plan can reach still resumes exactly
    assert (int(result), digest) == (12, reference[12])


def test_the_plan_is_frozen_lists_the_fallback_order_and_changes_nothing(trained):
    model, opt, sched, sampler = stepped_objects()
    before = live_bytes(model, opt)
    checked = []
    plan = plan_directory(trained, check_full=lambda path, index, outline: checked.append(index.step), stop_step=16)
    try:
        assert isinstance(plan, Plan) and plan.layout == "directory" and plan.target == 16
        assert [c.step for c in plan.candidates] == [12, 6, 0]
        assert all(c.reach == STEPS for c in plan.candidates)
        assert checked == [12]          # only the first candidate's header was checked against the objects
        assert [entry.first for entry, _ in plan.opened] == [13, 16]
        assert all(isinstance(reader, BatchReader) for _, reader in plan.opened)
        assert plan.newest_step == STEPS and plan.skipped == ()
        with pytest.raises(dataclasses.FrozenInstanceError):
            plan.target = 17   # type: ignore[misc]
    finally:
        plan.close()
    assert live_bytes(model, opt) == before


def test_a_full_checkpoint_that_fails_is_skipped_while_planning_and_named(ckpt, reference, caplog):
    """A full checkpoint whose header fails is passed over by the plan (warned, listed in
    ``skipped``); one whose payload fails is found by the executor, which falls back to the
    plan's next candidate. Both end exactly at the older one."""
    newest_full = named(ckpt, "full-000000000018")
    flip(newest_full, 0)
    plan = plan_directory(ckpt, check_full=lambda *args: None)
    try:
        assert [c.step for c in plan.candidates] == [12, 6, 0]
        assert [name for name, _ in plan.skipped] == [os.path.basename(newest_full)]
    finally:
        plan.close()
    payload_damaged = named(ckpt, "full-000000000012")
    flip(payload_damaged, 4096 + 8)
    result, digest = resumed_digest(ckpt, 14)
    assert (int(result), result.full_step, digest) == (14, 6, reference[14])
    assert [name for name, _ in result.skipped] == [os.path.basename(payload_damaged)]


def test_a_record_that_fails_during_the_replay_ends_in_the_same_refusal(ckpt):
    """The manifests say step 14 is reachable, so the plan goes ahead; a record of step 14 fails its
    checksum only when the replay reads it. The replay stops at step 13 and the resume is refused
    (the objects then hold step 13: what a failure found that late leaves behind)."""
    path = batch_file(ckpt, 13)
    with BatchReader(path) as reader:
        _, offset, nbytes = reader.entries[1]
    flip(path, offset + nbytes // 2)
    model, opt, sched, sampler = stepped_objects()
    with pytest.raises(lowdiff.NoCheckpointError, match=r"step 14 cannot be rebuilt; the newest reachable is 13"):
        recovery.resume(ckpt, model, opt, scheduler=sched, extra_state={"sampler": sampler}, step=14)
