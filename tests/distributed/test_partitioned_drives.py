"""The ranks of a node spread over its local drives (Options(stripe_dirs=...) under torch.distributed;
docs/format.md, "Rank directories on several local drives"), on real gloo processes
(partition_worker.py), with temporary directories as the drives: each rank's files land on its
drive; the job SIGKILLed and resumed with 2 ranks, then with 1, lands on the uninterrupted run's
state byte for byte; retention deletes on both drives, and the 1-rank run removes the dropped rank's
directory from its drive; a drive missing at resume is refused by name on every rank, without a
hang, and nothing is deleted or recreated. verify, inspect and export read the drive's files."""
import os
import sys

from lowdiff.cli.main import main as cli
from lowdiff.store.manifest import read_manifest

sys.path.insert(0, os.path.dirname(__file__))
import partition_worker  # noqa: E402
from partition_runs import STEPS, checkpoint_files, digests, launch, ok, resumed_exactly  # noqa: E402


def full_steps(directory):
    return sorted(int(n.split("-")[1]) for n in checkpoint_files(directory) if n.startswith("full-"))


def test_ranks_on_their_drives_killed_then_resumed_with_2_and_1_ranks(tmp_path, reference, capsys):
    ref, _ = reference
    ckpt, nvme1 = tmp_path / "ckpt", tmp_path / "nvme1" / "exp"
    drives = ("--stripe-dirs", str(nvme1))
    crashed = launch(ckpt, tmp_path / "run", 2, *drives, "--crash-at", "10", "--crash-ranks", "1")
    assert crashed[1][0] == -9
    # Local rank 0 writes in the checkpoint directory (drive 0), local rank 1 on the other drive.
    rank0, rank1 = ckpt / "rank-00000", nvme1 / "rank-00001"
    assert full_steps(rank0)[0] == 0 and full_steps(rank1)[0] == 0   # (the base set; 6 too, unless under load)
    assert os.listdir(ckpt / "rank-00001") == ["DRIVE.json"] and not (nvme1 / "rank-00000").exists()

    ok(launch(ckpt, tmp_path / "resumed", 2, *drives))
    resumed_exactly(tmp_path / "resumed", ref)
    # Retention on both drives: the set of step 0 went from each, nothing but the listed files is left.
    # (How many older sets a rank keeps depends on whether it saw the other's newest share committed.)
    for directory in (rank0, rank1):
        assert 0 not in full_steps(directory) and full_steps(directory)[-1] >= 12
        assert set(checkpoint_files(directory)) == read_manifest(str(directory)).files()
    assert cli(["verify", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert f"..{STEPS} from rank-00000/" in out and "ok       rank-00001/full-" in out and "0 do not" in out
    assert cli(["inspect", str(ckpt)]) == 0
    assert f"rank-00001: on {rank1}" in capsys.readouterr().out
    assert cli(["export", str(ckpt), "-o", str(tmp_path / "out.pt")]) == 0   # rank 1's shares from its drive
    assert partition_worker.exported_step_and_digest(tmp_path / "out.pt") == (STEPS, ref[0][STEPS][1])

    # One rank (the same drives given): rank 1's shares are read from its drive, the state is rank 0's
    # of the uninterrupted run; training on, rank 0 retires the old sets and removes rank 1's directory
    # from the drive, then its DRIVE.json.
    ok(launch(ckpt, tmp_path / "one", 1, *drives, steps=32))
    step, got = digests(tmp_path / "one-0.txt")
    assert step == STEPS and got[STEPS] == ref[0][STEPS]
    assert not rank1.exists() and not (ckpt / "rank-00001").exists()
    assert nvme1.is_dir() and cli(["verify", str(ckpt)]) == 0


def test_a_drive_missing_at_resume_is_refused_by_name_on_every_rank(tmp_path, capsys):
    ckpt, nvme1 = tmp_path / "ckpt", tmp_path / "nvme1" / "exp"
    ok(launch(ckpt, tmp_path / "run", 2, "--stripe-dirs", str(nvme1), steps=8))
    kept = checkpoint_files(nvme1 / "rank-00001")
    os.rename(tmp_path / "nvme1", tmp_path / "unmounted")
    # wrap() then resume(), and resume() of a plain optimizer (rank 0 plans for every rank).
    for extra in (("--stripe-dirs", str(nvme1)), ("--travel", "6")):
        for code, err in launch(ckpt, tmp_path / "again", 2, *extra, timeout=120):
            assert code not in (0, -9), err     # failed by itself on every rank, not killed at the deadline
            assert "MissingDeviceError" in err and str(nvme1 / "rank-00001") in err, err
    assert cli(["verify", str(ckpt)]) != 0
    assert str(nvme1 / "rank-00001") in capsys.readouterr().err
    assert not (tmp_path / "nvme1").exists()                    # the drive's directory is not recreated
    os.rename(tmp_path / "unmounted", tmp_path / "nvme1")
    assert checkpoint_files(nvme1 / "rank-00001") == kept        # nothing was deleted
    assert cli(["verify", str(ckpt)]) == 0
