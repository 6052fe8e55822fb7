"""Fallbacks of partitioned directories with real gloo ranks (partition_worker.py), resumed by 2
ranks that train on and by 1 rank, against the uninterrupted reference run (conftest.py), byte for
byte: a rank's MANIFEST.json damaged (rebuilt from its share files), a rank's differential share
torn (the chain ends where it is torn), time travel and training on; the tier choice by the rebuilt
view; a dropped rank's emptied directory removed (and a removal cut short by SIGKILL finished)."""
import logging
import os
import shutil
import sys

import pytest
import torch

import recovery
from lowdiff.cli.main import main as cli
from lowdiff.distributed.partition import rank_directories
from lowdiff.errors import MissingRankDirectoryError
from lowdiff.format.sharefile import parse_diff_share
from lowdiff.store.manifest import read_manifest, write_manifest
from recovery.tiers import tier_reach

sys.path.insert(0, os.path.dirname(__file__))
import partition_worker  # noqa: E402
from partition_runs import STEPS, checkpoint_files, copy_directory, digests, launch, ok  # noqa: E402

STOP = 10   # the run whose rank manifest is damaged stops here: set 6 and shares of steps 7..10


def assert_like_reference(ref, path_of, world, start, *, until=STEPS):
    """Every rank resumed at ``start`` with the reference's state there, and (training on) at ``until``."""
    for rank in range(world):
        got_start, got = digests(path_of(rank))
        assert got_start == start, f"rank {rank} resumed at {got_start}, expected {start}"
        assert got[start] == ref[rank][start], f"rank {rank}: state at step {start} differs"
        assert got[until] == ref[rank][until], f"rank {rank}: state at step {until} differs"


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The reference's first STOP steps (2 ranks, closed cleanly at step STOP)."""
    base = tmp_path_factory.mktemp("stopped")
    ok(launch(base / "ckpt", base / "run", 2, steps=STOP))
    return base / "ckpt"


def damage_manifest(directory, damage):
    manifest = directory / "MANIFEST.json"
    data = manifest.read_bytes()
    if damage == "corrupt":
        assert b'"step": 6' in data
        manifest.write_bytes(data.replace(b'"step": 6', b'"step": 7'))    # valid JSON, checksum fails
    elif damage == "truncate":
        manifest.write_bytes(data[:len(data) // 2])
    else:
        manifest.unlink()


# Each damage is rebuilt in one process by test_partitioned.py (and "truncate" there with 2 real ranks
# too); here 2 ranks train on after the rebuild: one damage by default, the other two with -m soak.
@pytest.mark.parametrize("damage", [pytest.param("corrupt", marks=pytest.mark.soak), "truncate",
                                    pytest.param("delete", marks=pytest.mark.soak)])
def test_damaged_rank_manifest_two_ranks_resume_and_train_on(tmp_path, reference, stopped, damage):
    """Without the rebuild rank 1 would list no share: no set complete, resume at step 0."""
    ref, _ = reference
    two, one = copy_directory(stopped, tmp_path / "two"), copy_directory(stopped, tmp_path / "one")
    files = checkpoint_files(two / "rank-00001")
    for directory in (two, one):
        damage_manifest(directory / "rank-00001", damage)
    err = ok(launch(two, tmp_path / "w2", 2))
    assert_like_reference(ref, lambda rank: tmp_path / f"w2-{rank}.txt", 2, STOP)
    assert str(two / "rank-00001" / "MANIFEST.json") in err and "rebuil" in err     # named, and what was done
    # One process (rank 0 of 2 gets its own state back; rank 1's is dropped, warned).
    err = ok(launch(one, tmp_path / "w1", 1, "--resume-only"))
    step, got = digests(tmp_path / "w1-0.txt")
    assert step == STOP and got[STOP] == ref[0][STOP]
    assert str(one / "rank-00001" / "MANIFEST.json") in err and "rebuil" in err
    # Its trainer (here rank 0, for the dropped rank) deleted nothing and committed the rebuilt list.
    assert checkpoint_files(one / "rank-00001") == files
    assert read_manifest(str(one / "rank-00001")).files() == set(files)


def _record_offset(path, step):
    index = parse_diff_share(str(path), path.read_bytes())
    return next(offset for s, offset, _ in index.batch.records if s == step)


# Both tears end the chain in one process in test_partitioned.py; with 2 ranks training on, the
# record-corrupted one (part of the share still used) by default, the truncated one with -m soak.
@pytest.mark.parametrize("tear", [pytest.param("truncated", marks=pytest.mark.soak), "record-corrupted"])
def test_torn_differential_share_two_ranks_resume_and_train_on(tmp_path, reference, tear):
    ref, directory = reference
    two, one = copy_directory(directory, tmp_path / "two"), copy_directory(directory, tmp_path / "one")
    name = next(n for n in checkpoint_files(two / "rank-00001") if n.startswith("diff-000000000013-"))  # 13..15
    for copy in (two, one):
        share = copy / "rank-00001" / name
        data = bytearray(share.read_bytes())
        if tear == "truncated":
            share.write_bytes(bytes(data[:len(data) - 100]))
        else:
            data[_record_offset(share, 14) + 40] ^= 0xFF      # inside the record of step 14
            share.write_bytes(bytes(data))
    # Truncated, the share's index is gone and with it which parameters it holds: none of it is used.
    expected = 12 if tear == "truncated" else 13
    err = ok(launch(two, tmp_path / "w2", 2))
    assert_like_reference(ref, lambda rank: tmp_path / f"w2-{rank}.txt", 2, expected)
    assert name in err and (f"resuming at step {expected}" in err or f"ends at step {expected}" in err)
    err = ok(launch(one, tmp_path / "w1", 1, "--resume-only"))
    step, got = digests(tmp_path / "w1-0.txt")
    assert step == expected and got[expected] == ref[0][expected]
    assert name in err


# 12 (the regression: a new base set on an old set's step) by default; 8 (mid-batch, reached by 2 ranks
# in test_partitioned.py's time travel to every retained step) with -m soak.
@pytest.mark.parametrize("travel", [pytest.param(8, marks=pytest.mark.soak), 12])
def test_time_travel_then_train_on_two_ranks(tmp_path, reference, travel):
    """Back to K (mid-batch: 8; a full set's step: 12) with the wrapped optimizer, then on to the end:
    the new timeline is the uninterrupted run's, and resuming it afterwards lands on its end. At 12
    the new session's base set shares the step with the old set, whose chain was dropped; the new
    session is named to sort before the old one (the old code tried the sets of one step in reverse
    name order: the old set, reaching only 12)."""
    ref, directory = reference
    copy = copy_directory(directory, tmp_path / "ckpt")
    err = ok(launch(copy, tmp_path / "tt", 2, "--resume-step", str(travel), "--lowest-session"))
    assert_like_reference(ref, lambda rank: tmp_path / f"tt-{rank}.txt", 2, travel)
    assert f"abandons steps {travel + 1}..{STEPS}" in err
    ok(launch(copy, tmp_path / "again", 2, "--resume-only"))
    for rank in range(2):
        step, got = digests(tmp_path / f"again-{rank}.txt")
        assert step == STEPS and got[STEPS] == ref[rank][STEPS]


def _resume_in_process(directory, **options):
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = recovery.resume(directory, model, opt, **options)
    return start, partition_worker.shared_digest(model, opt)


def test_tier_reach_uses_the_rebuilt_view_of_a_damaged_rank_manifest(tmp_path, reference, caplog):
    """Local tier: rank 1's manifest truncated (its shares reach step 16 by their files); shared tier:
    complete, but rank 1's last share missing (reaches 15). Judged by the committed manifests the
    local tier would reach only 12, and resume would take the shared tier's 15."""
    ref, directory = reference
    local, shared = copy_directory(directory, tmp_path / "local"), copy_directory(directory, tmp_path / "shared")
    manifest = local / "rank-00001" / "MANIFEST.json"
    manifest.write_bytes(manifest.read_bytes()[:200])
    rank1 = str(shared / "rank-00001")
    listed = read_manifest(rank1)
    newest = max(listed.batches, key=lambda b: b.last)
    listed.batches.remove(newest)
    write_manifest(rank1, listed)
    os.unlink(os.path.join(rank1, newest.file))
    assert tier_reach(str(local), None) == STEPS
    assert tier_reach(str(shared), None) == STEPS - 1
    assert tier_reach(str(local), 14) == 14
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        start, got = _resume_in_process(local, shared_dir=shared)
    assert (int(start), start.tier) == (STEPS, "local") and got == ref[0][STEPS][1]
    assert "rank-00001" in caplog.text and "rebuil" in caplog.text


def test_dropped_rank_directory_is_removed_once_emptied(tmp_path, reference, capsys):
    """2 ranks to 16, then 1 rank to 32 (full sets of 1 share at 16, 22, 28): rank-00001/ goes once
    its last shares are retired. A SIGKILL between deleting its manifest and its LOCK leaves a rank
    directory that lists nothing (resume and verify are unaffected); the next start removes it."""
    ref, directory = reference
    killed_copy = copy_directory(directory, tmp_path / "killed")
    copy = copy_directory(directory, tmp_path / "ckpt")
    ok(launch(copy, tmp_path / "one", 1, steps=32))
    assert sorted(rank_directories(copy)) == [0]
    assert not (copy / "rank-00001").exists()
    assert cli(["verify", str(copy)]) == 0
    capsys.readouterr()
    _, trained = digests(tmp_path / "one-0.txt")
    step, got = _resume_in_process(copy)
    assert int(step) == 32 and got == trained[32][1]
    # The same with a kill: "dropped-clean" is reached after each deletion of a retired share of
    # rank-00001/ (all of them, as the uninterrupted run shows), then after deleting its
    # CONTROLLER.json and after its MANIFEST.json: killed there, its LOCK is left.
    retired = len(checkpoint_files(killed_copy / "rank-00001"))
    killed = launch(killed_copy, tmp_path / "killed", 1, steps=32, fault_rank=0, fault=f"dropped-clean:{retired + 2}")
    assert killed[0][0] == -9
    left = killed_copy / "rank-00001"
    assert sorted(os.listdir(left)) == ["LOCK"]
    step, got = _resume_in_process(killed_copy)                         # (killed at the full set of 22)
    assert STEPS < int(step) < 32 and got == trained[int(step)][1]
    assert cli(["verify", str(killed_copy)]) == 0
    capsys.readouterr()
    ok(launch(killed_copy, tmp_path / "after", 1, steps=32))
    assert not left.exists() and sorted(rank_directories(killed_copy)) == [0]
    assert digests(tmp_path / "after-0.txt")[1][32] == trained[32]


def test_dropped_rank_directory_with_files_not_ours_stays(tmp_path, reference):
    """A dropped rank directory that holds a file lowdiff cannot explain keeps it, and is not removed."""
    _, directory = reference
    copy = copy_directory(directory, tmp_path / "ckpt")
    (copy / "rank-00001" / "notes.txt").write_text("the user's")
    err = ok(launch(copy, tmp_path / "one", 1, steps=32))
    assert sorted(os.listdir(copy / "rank-00001")) == ["CONTROLLER.json", "LOCK", "MANIFEST.json", "notes.txt"]
    assert read_manifest(str(copy / "rank-00001")).files() == set()
    assert "notes.txt" in err and "left in place" in err


def test_missing_rank_directory_is_refused_by_name_and_nothing_is_deleted(tmp_path, stopped, capsys):
    """Issue #33, 1: ``rank-00001/`` absent (a volume not mounted yet) was read as empty: one
    process resumed at 0 and, three steps and a close later, rank 0's files were all deleted. Now
    wrap (1 and 2 processes), resume, verify and inspect refuse or report it by name; nothing is
    deleted and the directory is not recreated."""
    one = copy_directory(stopped, tmp_path / "one")
    files = checkpoint_files(one / "rank-00000")
    listed = read_manifest(str(one / "rank-00000")).files()
    shutil.rmtree(one / "rank-00001")
    missing = str(one / "rank-00001")
    for world in (1, 2):
        results = launch(one, tmp_path / f"w{world}", world)
        for code, err in results:
            assert code != 0, err
            assert "MissingRankDirectoryError" in err and missing in err and "mount or copy" in err
        assert checkpoint_files(one / "rank-00000") == files
        assert read_manifest(str(one / "rank-00000")).files() == listed
        assert not os.path.exists(missing)
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(MissingRankDirectoryError, match="rank-00001"):
        recovery.resume(str(one), model, opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())) and not opt.state
    capsys.readouterr()
    assert cli(["verify", str(one)]) == 1
    out = capsys.readouterr().out
    assert "MISSING" in out and missing in out
    assert cli(["inspect", str(one)]) == 0
    assert "rank-00001: MISSING" in capsys.readouterr().out
    assert checkpoint_files(one / "rank-00000") == files and not os.path.exists(missing)


def test_an_incomplete_set_older_than_a_complete_one_is_not_called_a_fault(tmp_path, stopped, capsys, caplog):
    """Issue #33, 3: after a clean close, one rank may already have retired its share of an old set
    that another still lists (retention lag). Resume and verify warned "incomplete ... a rank died
    while writing?; falling back" although no rank died and nothing fell back. Only a set newer than
    every complete one is a fallback worth a warning."""
    copy = copy_directory(stopped, tmp_path / "lag")
    rank1 = str(copy / "rank-00001")
    manifest = read_manifest(rank1)
    oldest = min(manifest.fulls, key=lambda f: f.step)
    assert oldest.step < max(f.step for f in manifest.fulls)
    manifest.fulls.remove(oldest)
    write_manifest(rank1, manifest)                  # rank 1 retired its share first ...
    os.unlink(os.path.join(rank1, oldest.file))     # ... and deleted it; rank 0 still lists its own
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        assert int(recovery.resume(str(copy), model, opt)) == STOP
        capsys.readouterr()
        assert cli(["verify", str(copy)]) == 0
    said = [r.getMessage() for r in caplog.records] + [capsys.readouterr().out]
    assert any("per-rank state" in m for m in said), said          # (what a 1-rank resume does say)
    assert not any("incomplete" in m or "falling back" in m for m in said), said
