"""The fault-injection coverage issue #33 asked for (kills.py, fulldisk.py): SIGKILL at random
crash points of runs with full_every/batch_steps "auto" (the controller's CONTROLLER.json write
among them); real ``torchrun --max-restarts`` restarts after a SIGKILL at a random crash point, DDP
with storage tiers and DDP in replica mode; a full disk on ext4 (which takes O_DIRECT) on a loop
device, for the local and the shared tier. One case each here (random, seeded by the test's id);
``campaign.py`` runs many."""
from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

import fulldisk  # noqa: E402
import kills  # noqa: E402
from lowdiff_helpers import reference_digests  # noqa: E402

AUTO_STEPS = 24


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _checked(kill: kills.Kill) -> None:
    assert not kill.problems, "\n".join(kill.problems)
    assert kill.killed, f"{kill.where}: the crash point was never reached"
    assert kill.resumes == kill.exact >= 2


def test_auto_settings_killed_at_a_random_crash_point(tmp_path, rng):
    """full_every="auto", batch_steps="auto" as keywords (the Auto schedule: the test below)."""
    # The phases every such run reaches early (retention and manifest-commit too: KeepLast(4)).
    phase = str(rng.choice(["record", "batch-write", "batch-commit", "full-write", "full-commit",
                            "manifest-write", "manifest-commit", "controller-write"]))
    kill = kills.auto_kill(str(tmp_path), "keywords", phase, int(rng.integers(1, 3)), AUTO_STEPS,
                           reference_digests(AUTO_STEPS))
    _checked(kill)


def test_controller_write_is_a_crash_point(tmp_path):
    """A SIGKILL while CONTROLLER.json's new copy is synced under its temporary name (fails on the
    old code: no such crash point)."""
    _checked(kills.auto_kill(str(tmp_path), "auto", "controller-write", 1, AUTO_STEPS,
                             reference_digests(AUTO_STEPS)))


# With -m soak (random points: coverage; campaign.py runs many): torchrun restarting DDP with tiers
# after a SIGKILL runs by default in the regression test at the end of this file, torchrun restarts
# after a SIGKILL in tests/distributed/test_torchrun.py, replica mode SIGKILLed and resumed exactly in
# tests/distributed/test_replica_ddp.py and tests/integration/test_replica_kill.py.
@pytest.mark.soak
@pytest.mark.parametrize("mode", ["tiers", "replica"])
def test_torchrun_restarts_after_a_sigkill_at_a_random_crash_point(tmp_path, rng, mode):
    phases = ["record", "batch-write", "batch-commit", "full-write", "full-commit", "manifest-write",
              "manifest-commit"] + (["drain-write", "drain-commit"] if mode == "tiers" else [])
    phase, count, rank = str(rng.choice(phases)), int(rng.integers(1, 3)), int(rng.integers(0, 2))
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    reference = kills.ddp_reference(str(tmp_path / "ref"), "dense" if mode == "replica" else "topk")
    _checked(kills.torchrun_kill(str(tmp_path / "run"), mode, phase, count, rank, reference))


@pytest.mark.parametrize("tier", ["local", "shared"])
def test_full_disk_on_ext4_with_o_direct(tmp_path, rng, tier):
    free_kib = int(rng.integers(100, 250))
    try:
        problems = fulldisk.run_full_disk(str(tmp_path), tier, free_kib, reference_digests(fulldisk.MAX_STEPS))
    except OSError as exc:
        pytest.skip(f"no ext4 on a loop device here: {exc}")
    assert not problems, "\n".join(problems)


def test_torchrun_with_tiers_restarts_after_rank_0_died_before_committing(tmp_path):
    """Regression (found by campaign.py): rank 0 SIGKILLed at its first record, before it
    committed anything, while rank 1 committed and drained its shares. On the restart every rank
    took rank 0's fresh run, and rank 1 refused its own shared tier ('the shared tier belongs to
    another training run'), so torchrun's restart failed. The run of the lowest rank with files is
    now every rank's."""
    (tmp_path / "ref").mkdir()
    (tmp_path / "run").mkdir()
    reference = kills.ddp_reference(str(tmp_path / "ref"), "topk")
    _checked(kills.torchrun_kill(str(tmp_path / "run"), "tiers", "record", 1, 0, reference))
