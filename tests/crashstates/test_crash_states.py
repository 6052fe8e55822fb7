"""Power loss (issue #33, 5): the crash-state explorer over a full checkpoint, a batch commit, a
retention pass, a tier drain and a partitioned set commit. Each workload runs in a real process
under the tracer (tracer.py); the states a power loss could leave at each barrier (fsmodel.py) are
built and, for a bounded sample drawn with a fixed seed, checked: resume reaches at least the step
reported durable before the barrier, byte for byte the uninterrupted run's state, and later sessions
delete nothing still needed (checker.py, partitioned.py). ``python tests/crashstates/campaign.py``
checks every state built and prints the totals.
"""
from __future__ import annotations

import os
import shutil
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

import checker  # noqa: E402
import explore  # noqa: E402
import fsmodel  # noqa: E402
import partitioned  # noqa: E402
import workload  # noqa: E402
from lowdiff_helpers import build, reference_digests, train_steps, wrap  # noqa: E402

SAMPLES = 4          # random states per crash point, besides the prefixes of directory operations
CI_STATES = 8        # states checked per single-process workload in CI, every kind of state among them
                     # (explore.pick; the campaign checks all)
CI_PARTITIONED = 24  # states of the partitioned workload (resumed in one process)
CI_LATER = 1         # of which this many get a later 2-rank session


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(workload.WORKLOADS))
def test_power_loss_states_resume_exactly(name, tmp_path):
    work = workload.WORKLOADS[name]
    reference = reference_digests(work.steps + work.extra)
    kinds: set = set()

    def check(root, required, state):
        kinds.add(explore.kind_of(state))
        return checker.check(work, root, required, reference)

    report = explore.explore(name, str(tmp_path), samples=SAMPLES, limit=CI_STATES, seed=33, check=check)
    print(report.line())
    assert report.checked == min(CI_STATES, report.built) and report.built > report.points
    assert kinds == {"no pending data", "all pending data", "sample"}, kinds   # every kind among the few
    assert not report.failures, "\n".join(report.failures)


@pytest.mark.parametrize("model", ["journal", "per-directory"])
def test_power_loss_states_of_a_partitioned_set_commit(tmp_path, model):
    """Also in the weaker per-directory model (fsmodel.py): the rank directories are directories of
    their own, whose creation must be made durable through the parent."""
    reference: dict = {}
    later = [CI_LATER if model == "journal" else 0]

    def check(root, required, state):
        if not reference:
            reference.update(partitioned.reference_of(str(tmp_path / "run")))
        later[0] -= 1
        return partitioned.check(root, required, reference, str(tmp_path), later=later[0] >= 0)

    report = explore.explore("partitioned", str(tmp_path), samples=SAMPLES, limit=CI_PARTITIONED, seed=33,
                             check=check, model=model)
    print(report.line())
    assert report.checked == CI_PARTITIONED
    assert not report.failures, "\n".join(report.failures)


def test_a_half_committed_first_partitioned_set_restarts_from_scratch(tmp_path):
    """Regression (found by the explorer): power lost while the first full set was committed, rank
    0's share renamed into place and rank 1's not, no manifest yet. A 2-rank restart failed with
    NoCheckpointError (rank 0's share read as a whole checkpoint of the layout before partitioning);
    it must start from step 0 and train to the uninterrupted run's state."""
    root = tmp_path / "root"
    partitioned.launch(str(root), str(tmp_path / "run"), traced=False)
    reference = partitioned.reference_of(str(tmp_path / "run"))
    ckpt = root / "ckpt"
    share = min(n for n in os.listdir(ckpt / "rank-00000") if n.startswith("full-"))
    kept = (ckpt / "rank-00000" / share).read_bytes()
    shutil.rmtree(ckpt)
    (ckpt / "rank-00001").mkdir(parents=True)
    (ckpt / "rank-00000").mkdir()
    (ckpt / "rank-00000" / share).write_bytes(kept)
    partitioned.launch(str(root), str(tmp_path / "again"), traced=False)
    step, digest = partitioned.resumed_shared(str(root))
    assert step == partitioned.STEPS and digest == reference[step]


def test_batches_committed_before_the_first_full_checkpoint_resume_from_scratch(tmp_path):
    """Regression (found by the explorer, retention workload): the batch writer renamed its first
    batch into place before the full checkpoint of step 0 was (the two writer threads commit
    independently), and the power went: a temporary full checkpoint, a batch, no manifest. Every
    restart failed with NoCheckpointError ('no full checkpoint verifies'); nothing of that run was
    durable, so resume must start at 0, and the restarted run must train exactly."""
    work = workload.Workload("orphan", steps=3, full_every=100, batch_steps=1)
    root = str(tmp_path)
    ckpt = workload.directories(root)[0]
    model, opt, sched, sampler = build()
    opt = wrap(ckpt, model, opt, sched, sampler, **workload.options(work, root))
    train_steps(model, opt, sched, sampler, 0, work.steps)
    opt.close()
    full = [n for n in os.listdir(ckpt) if n.startswith("full-")]
    assert len(full) == 1 and any(n.startswith("diff-") for n in os.listdir(ckpt))
    os.rename(os.path.join(ckpt, full[0]), os.path.join(ckpt, f".{full[0]}.tmp-999999-0badf00d"))
    os.unlink(os.path.join(ckpt, "MANIFEST.json"))
    reference = reference_digests(work.steps + work.extra)
    outcome = checker.check(work, root, -1, reference)
    assert outcome.kind == "exact" and outcome.resumed == 0, outcome


def test_new_directories_are_made_durable(tmp_path):
    """Regression (found by the explorer in the per-directory model): a checkpoint directory (a
    rank directory, a tier) was created without an fsync of its parent, so a power loss could drop
    it with every synced file in it. At the end of a run every mkdir must be durable."""
    root = tmp_path / "root"
    root.mkdir()
    program = fsmodel.resolve([explore.trace(os.path.join(HERE, "workload.py"), ["batch", str(root)], str(root),
                                             str(tmp_path / "trace.pkl"))])
    end = fsmodel.durability(program, len(program.ops))
    position = 0
    for op in program.ops:
        if op[0] in fsmodel.META:
            if op[0] == "mkdir":
                durable, positions = end.by_dir[fsmodel.parent(op[1])]
                assert position in positions[:durable], f"mkdir {op[1]!r} is never made durable"
            position += 1


# ------------------------------------------------------------------ the persistence model itself
def _program(ops):
    """A program from a hand-written trace of one process (times are the list order)."""
    return fsmodel.resolve([[(t, 1, *op) for t, op in enumerate(ops)]])


def _all_states(program):
    rng = np.random.default_rng(0)
    return [state for point in program.barriers() for state in fsmodel.states(program, point, rng, 64)]


def test_the_model_keeps_what_a_barrier_made_durable_and_tears_the_rest():
    """The commit protocol (data, fdatasync, rename, directory fsync): at the end the new file is
    whole under its name in every state; before the directory fsync it may be there or not; the
    data before its fdatasync may be torn at sector granularity."""
    payload = bytes(range(256)) * 8   # 4 sectors
    program = _program([("mkdir", "d"), ("open", "h1", "d/.f.tmp", True, False), ("write", "h1", 0, payload),
                        ("sync", "h1"), ("rename", "d/.f.tmp", "d/f"), ("open", "h2", "d", False, False),
                        ("sync", "h2")])
    end = [s for s in fsmodel.states(program, len(program.ops), np.random.default_rng(0), 16)]
    assert {tuple(sorted(s.files.items())) for s in end} == {(("d/f", payload),)}
    states = _all_states(program)
    torn = [s for s in states if any(0 < len(v) and v != payload[:len(v)] or 0 < len(v) < len(payload)
                                     for v in s.files.values())]
    assert torn, "no torn state of the unsynced write was built"
    assert all(s.files.get("d/f", payload) == payload for s in states), "a renamed file lost synced data"


def test_the_model_finds_a_rename_before_fdatasync():
    """Renaming before the data is synced (the bug the protocol exists to avoid) must yield a state
    where the final name holds incomplete data: the explorer can see that class of bug."""
    payload = b"x" * 2048
    program = _program([("open", "h1", ".f.tmp", True, False), ("write", "h1", 0, payload),
                        ("rename", ".f.tmp", "f"), ("open", "h2", "", False, False), ("sync", "h2")])
    assert any("f" in s.files and s.files["f"] != payload for s in _all_states(program))
