"""A partitioned directory's recovery plan (recovery.partitioned.restore.plan_partitioned): frozen,
its full sets in the order recovery falls back in, and a target step that the rank directories'
manifests do not retain refused before a byte of the live objects changes. One process resumes a
directory that two ranks wrote (without a process group the same code reads every share)."""
import dataclasses
import logging
import os
import sys

import pytest
import torch

import lowdiff
import recovery
from recovery.partitioned.restore import plan_partitioned

sys.path.insert(0, os.path.dirname(__file__))
import partition_worker  # noqa: E402
from partition_runs import STEPS, copy_directory, digests, launch, ok  # noqa: E402


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Two ranks, STEPS steps: full sets at 6 and 12 kept; differentials of 3 steps."""
    base = tmp_path_factory.mktemp("partitioned-plan")
    ok(launch(base / "ckpt", base / "run", 2))
    return base / "ckpt", digests(base / "run-0.txt")[1]


def warm_objects():
    """Fresh objects, then one step, so that the optimizer has state a resume would read into."""
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def live_bytes(model, opt) -> list:
    out = [(key, value.detach().numpy().tobytes()) for key, value in model.state_dict().items()]
    for index, state in sorted(opt.state_dict()["state"].items()):
        out.extend((f"{index}/{name}", value.numpy().tobytes()) for name, value in sorted(state.items()))
    return out


def test_a_step_that_is_not_retained_is_refused_before_anything_changes(written):
    directory, _ = written
    model, opt = warm_objects()
    before = live_bytes(model, opt)
    with pytest.raises(lowdiff.NoCheckpointError, match=rf"step {STEPS + 5} is not retained; retained steps: "):
        recovery.resume(directory, model, opt, step=STEPS + 5)
    assert live_bytes(model, opt) == before


def test_the_plan_is_frozen_lists_the_sets_newest_first_and_changes_nothing(written):
    directory, _ = written
    checked = []
    plan = plan_partitioned(str(directory), check_full=lambda *args: checked.append(args), stop_step=14)
    assert (plan.layout, plan.directory, plan.target) == ("partitioned", str(directory), 14)
    assert [c.step for c in plan.candidates] == [12, 6]   # (retention dropped the set of step 0)
    assert all(c.reach == STEPS for c in plan.candidates) and plan.newest_step == STEPS
    assert [c.source.count for c in plan.candidates] == [2, 2] and plan.skipped == ()
    assert checked == []   # the sets are read (and checked against the objects) when executed
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.target = 15   # type: ignore[misc]


def test_the_planned_step_resumes_exactly(written):
    directory, reference = written
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = recovery.resume(directory, model, opt, step=10)
    assert (int(start), start.full_step) == (10, 6)
    assert partition_worker.shared_digest(model, opt) == reference[10][1]


def test_a_step_beyond_a_share_file_that_fails_is_refused_before_anything_changes(written, tmp_path, caplog):
    """Rank 1's differential file of steps 13..15 is not a lowdiff file: the set of step 12 is the
    one a resume at step 14 starts from, and its shares continue it together only to step 12 by
    their files' indexes. Refused with the words the replay would end in, the objects untouched;
    the steps the files do reach still resume exactly."""
    directory, reference = written
    directory = copy_directory(directory, tmp_path / "ckpt")
    rank1 = directory / "rank-00001"
    flip(rank1 / next(n for n in sorted(os.listdir(rank1)) if n.startswith("diff-000000000013-")), 0)
    model, opt = warm_objects()
    before = live_bytes(model, opt)
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        with pytest.raises(lowdiff.NoCheckpointError, match=r"step 14 cannot be rebuilt; the newest reachable is 12"):
            recovery.resume(directory, model, opt, step=14)
    assert live_bytes(model, opt) == before
    assert "the chain of share 1 ends at step 12" in caplog.text
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert int(recovery.resume(directory, model, opt, step=12)) == 12
    assert partition_worker.shared_digest(model, opt) == reference[12][1]


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
