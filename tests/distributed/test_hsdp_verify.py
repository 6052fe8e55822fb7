"""``verify`` of an HSDP directory checks what each share names in `elsewhere` (docs/format.md, "2-D
meshes"): a share whose chunks another rank of its replicate group wrote is usable only if that share
is there, verifies, and holds those chunks (key, chunk entry, dtype) — for full-checkpoint shares
and differential shares alike. A missing or damaged holder, or one that does not hold the chunk, is a
"HOLDER" problem of the share that names it, naming both files, and the set (or the chain) is not
counted recoverable past it. Before, verify checked each file alone and called such a directory
sound. Resume makes the same checks: from a full set whose holder does not hold the chunk it falls
back to the older set, at the same mesh and resharded (before, the resharded state was silently
wrong); a differential chain is not replayed past such a file (before, silently wrong too).

One uninterrupted 4-rank HSDP run (a (2, 2) mesh, TopK, AdamW, 8 steps: full sets at 4 and 8,
differential shares of two steps); each test changes a copy of its directory."""
import json
import os
import subprocess
import sys

import pytest

from lowdiff.format import container
from recovery.partitioned.verify import verify_partitioned

sys.path.insert(0, os.path.dirname(__file__))
from test_fsdp2_hsdp import HSDP, launch  # noqa: E402
from test_fsdp2_resume import copied, digests, ok  # noqa: E402

pytestmark = pytest.mark.four_ranks


@pytest.fixture(scope="module")
def hsdp_dir(tmp_path_factory):
    """(the uninterrupted run's digests by rank, its directory, rank 0's gathered digests)."""
    base = tmp_path_factory.mktemp("hsdp-verify")
    ok(launch(base / "ckpt", base / "ref", 4, *HSDP))
    return [digests(base / f"ref-{rank}.txt")[1] for rank in range(4)], base / "ckpt", \
        digests(base / "ref-0.txt", column=-2)[1]


def _newest(directory, rank: int, prefix: str) -> str:
    return sorted(n for n in os.listdir(directory / f"rank-{rank:05d}") if n.startswith(prefix))[-1]


def _index(path) -> tuple:
    """(the index as JSON, its offset) of a lowdiff file."""
    with open(path, "rb") as f:
        data = f.read()
    offset, length, _, _, _, _ = container.TRAILER.unpack(data[-container.TRAILER.size:])
    return json.loads(data[offset:offset + length]), offset


def _rewrite_index(path, change) -> None:
    """Rewrite the index of the file at ``path`` as ``change(index)`` makes it, keeping its length
    (so the manifest's size still holds) and a valid checksum: a file that verifies alone."""
    index, offset = _index(path)
    old = container.encode_index(index)
    change(index)
    new = container.encode_index(index)
    assert len(new) == len(old) and new != old
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(new + container.trailer_bytes(offset, new, container.file_kind(str(path))))


def _bump_offset(entry: dict) -> None:
    """A chunk entry of rank 0 (its chunks start at 0) moved by one row: still a valid entry."""
    assert entry["offsets"][0] == 0
    entry["offsets"][0] = 1


def _problems(directory) -> dict:
    report = verify_partitioned(directory)
    return {os.path.relpath(p.file, directory): p for p in report.problems}, report


def test_an_intact_hsdp_directory_verifies_clean(hsdp_dir):
    directory = hsdp_dir[1]
    problems, report = _problems(directory)
    assert not problems and report.ok
    # (step 0's set may be retired already on some ranks: retention runs on each rank by itself)
    assert {4, 8} <= {step for step, _, _ in report.recoverable} and report.newest_recoverable == 8
    assert _index(directory / "rank-00002" / _newest(directory, 2, "full-"))[0]["elsewhere"]   # HSDP indeed


def test_a_missing_holder_full_share_is_named_by_the_share_that_needs_it(tmp_path, hsdp_dir):
    directory = copied(hsdp_dir[1], tmp_path / "run")
    name = _newest(directory, 0, "full-")
    os.remove(directory / "rank-00000" / name)
    problems, report = _problems(directory)
    holder, dependent = f"rank-00000/{name}", f"rank-00002/{name}"
    assert problems[holder].label == "MISSING"
    assert problems[dependent].label == "HOLDER"
    why = problems[dependent].why
    assert f"share 0 ({directory / holder}), which is missing, holds its chunk" in why, why
    assert 8 not in [step for step, _, _ in report.recoverable] and not report.ok
    # the command line prints it, naming both files, and fails
    result = subprocess.run([sys.executable, "-m", "lowdiff", "verify", str(directory)], capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 1
    line = next(line for line in result.stdout.splitlines() if line.startswith("HOLDER"))
    assert str(directory / dependent) in line and str(directory / holder) in line, result.stdout


def test_a_damaged_holder_full_share_is_named_by_the_share_that_needs_it(tmp_path, hsdp_dir):
    """A byte of a chunk rank 0 holds for rank 2 flipped: rank 0's share is CORRUPT, and rank 2's is
    a HOLDER problem naming it (its own bytes verify; without rank 0's it is of no use)."""
    directory = copied(hsdp_dir[1], tmp_path / "run")
    name = _newest(directory, 0, "full-")
    dependent, _ = _index(directory / "rank-00002" / name)
    key = sorted(k for k, where in dependent["elsewhere"].items() if where["share"] == 0)[0]
    holder, _ = _index(directory / "rank-00000" / name)
    (entry,) = [t for t in holder["tensors"] if t["key"] == key]
    with open(directory / "rank-00000" / name, "r+b") as f:
        f.seek(entry["offset"] + 3)
        byte = f.read(1)
        f.seek(entry["offset"] + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems, report = _problems(directory)
    assert problems[f"rank-00000/{name}"].label == "CORRUPT"
    assert problems[f"rank-00002/{name}"].label == "HOLDER"
    why = problems[f"rank-00002/{name}"].why
    assert f"share 0 ({directory / 'rank-00000' / name}), which does not verify, holds its chunk" in why, why
    assert repr(key) in why and 8 not in [step for step, _, _ in report.recoverable]


def _move_held_chunk(directory) -> tuple:
    """Rank 0's newest full share says its chunk of a key rank 2 names it for is one row further:
    (the share's name, the key)."""
    name = _newest(directory, 0, "full-")
    dependent, _ = _index(directory / "rank-00002" / name)
    key = sorted(k for k, where in dependent["elsewhere"].items() if where["share"] == 0)[0]
    _rewrite_index(directory / "rank-00000" / name, lambda index: _bump_offset(index["dtensors"][key]))
    return name, key


def test_resharding_falls_back_from_a_holder_without_the_named_chunk(tmp_path, hsdp_dir):
    """The same set resumed at 2 ranks (FSDP2 on a 1-D mesh): each new chunk is cut from the shares
    that hold the recorded ones. Before, share 0's chunk was cut in at the place its entry says, and
    the resumed state was wrong (gathered), with no warning; now every rank falls back to step 4's set
    (the warning names both files) and replays to step 8: gathered, the uninterrupted run's state."""
    directory = copied(hsdp_dir[1], tmp_path / "run")
    name, key = _move_held_chunk(directory)
    extra = [a for a in HSDP if a != "--hsdp"]
    err = ok(launch(directory, tmp_path / "at2", 2, "--resume-only", *extra))
    assert f"{directory / 'rank-00000' / name} is named by share 2 ({directory / 'rank-00002' / name})" in err, err
    assert "falling back" in err, err
    gathered = hsdp_dir[2]
    for rank in range(2):
        step, got = digests(tmp_path / f"at2-{rank}.txt", column=-2)
        assert step == 8 and got[8] == gathered[8], rank


def test_a_holder_full_share_without_the_named_chunk_is_found_and_resume_falls_back(tmp_path, hsdp_dir):
    """Share 0 verifies alone, but its chunk entry of a key share 2 names it for says another place
    (offsets): share 2's file is unusable, the set of step 8 not recoverable; resume falls back to
    the set of step 4 (with a warning naming share 0) and replays to step 8, exactly."""
    reference, directory = hsdp_dir[0], copied(hsdp_dir[1], tmp_path / "run")
    name, key = _move_held_chunk(directory)
    problems, report = _problems(directory)
    assert list(problems) == [f"rank-00002/{name}"] and problems[f"rank-00002/{name}"].label == "HOLDER"
    why = problems[f"rank-00002/{name}"].why
    assert f"share 0 ({directory / 'rank-00000' / name}) is named for chunks it does not hold" in why, why
    assert f"the chunk of {key!r} with offsets [1, " in why and "(named with [0, " in why, why
    assert max(step for step, _, _ in report.recoverable) == 4 and report.newest_recoverable == 8
    err = ok(launch(directory, tmp_path / "res", 4, *HSDP))
    assert "share 0 of the full checkpoint of step 8" in err and "falling back" in err, err
    for rank in range(4):
        step, got = digests(tmp_path / f"res-{rank}.txt")
        assert step == 8 and got[8] == reference[rank][8], rank   # from step 4's set, replayed to 8


def _dependent_diff(directory, first: int | None = None) -> tuple:
    """(rank 2's newest differential share's name (or the one from step ``first``), its index, a
    slot it names share 0 for, rank 0's differential share of the same steps)."""
    name = _newest(directory, 2, "diff-" if first is None else f"diff-{first:012d}-")
    index, _ = _index(directory / "rank-00002" / name)
    slot = sorted(s for s, share in index["elsewhere"] if share == 0)[0]
    steps = (index["first"], index["last"])
    holder = next(n for n in os.listdir(directory / "rank-00000") if n.startswith("diff-")
                  and tuple(_index(directory / "rank-00000" / n)[0][k] for k in ("first", "last")) == steps)
    return name, index, slot, holder


def _move_recorded_chunk(directory, holder: str, slot: int) -> None:
    """Rank 0's differential share ``holder`` says its chunk of parameter ``slot`` is one row further."""
    def move(held):
        (entry,) = [e for s, e in held["dtensors"] if s == slot]
        _bump_offset(entry)
    _rewrite_index(directory / "rank-00000" / holder, move)


def test_a_holder_differential_share_without_the_named_chunk_ends_the_chain(tmp_path, hsdp_dir):
    directory = copied(hsdp_dir[1], tmp_path / "run")
    name, index, slot, holder = _dependent_diff(directory)
    _move_recorded_chunk(directory, holder, slot)
    problems, report = _problems(directory)
    assert list(problems) == [f"rank-00002/{name}"] and problems[f"rank-00002/{name}"].label == "HOLDER"
    why = problems[f"rank-00002/{name}"].why
    assert f"share 0 ({directory / 'rank-00000' / holder}) is named for chunks it does not hold" in why, why
    assert f"the gradient chunk of parameter {slot} with offsets [1" in why, why
    # the chain of step 4's set ends before rank 2's file (steps index["first"]..)
    assert dict((step, last) for step, _, last in report.recoverable)[4] == index["first"] - 1
    assert not report.ok


def _resume_without_step_8s_set(tmp_path, directory, reference, first: int) -> None:
    """Remove the full set of step 8: a resume takes step 4's and replays its differentials, and
    ends at step ``first`` - 1 (with a warning), where verify says the chain ends; then trains on
    to step 8 exactly as the uninterrupted run did."""
    for rank in range(4):
        os.remove(directory / f"rank-{rank:05d}" / _newest(directory, rank, "full-"))
    assert dict((step, last) for step, _, last in verify_partitioned(directory).recoverable)[4] == first - 1
    err = ok(launch(directory, tmp_path / "res", 4, *HSDP))
    assert "share 0" in err and "rank-00000" in err, err
    for rank in range(4):
        step, got = digests(tmp_path / f"res-{rank}.txt")
        assert step == first - 1 and sorted(got) == list(range(step, 9)), (rank, step)
        for s, value in got.items():
            assert value == reference[rank][s], (rank, s)


def test_resume_does_not_replay_a_chain_whose_first_holder_lacks_the_chunk(tmp_path, hsdp_dir):
    """Rank 0's first differential share after step 4 says its chunk of a parameter rank 2 names it
    for is one row further. Before, resume cut rank 2's chunk (and rank 0's own) from chunks that do
    not tile it: ranks 0 and 2 resumed a wrong state, silently. Now the chain is not replayed
    (a warning names both files) and the job resumes at step 4, exactly."""
    reference, directory = hsdp_dir[0], copied(hsdp_dir[1], tmp_path / "run")
    _, _, slot, holder = _dependent_diff(directory, first=5)
    _move_recorded_chunk(directory, holder, slot)
    _resume_without_step_8s_set(tmp_path, directory, reference, first=5)


@pytest.mark.soak
def test_resume_ends_a_chain_where_a_later_file_names_other_chunks(tmp_path, hsdp_dir):
    """The same in rank 0's second file after step 4 (steps 7-8): it names other chunks than the
    chain's first file. Before, resume replayed it as if it agreed (the chunk entries of the first
    file were used); now share 0's chain ends before it, at step 6, as verify says."""
    reference, directory = hsdp_dir[0], copied(hsdp_dir[1], tmp_path / "run")
    _, _, slot, holder = _dependent_diff(directory, first=7)
    _move_recorded_chunk(directory, holder, slot)
    _resume_without_step_8s_set(tmp_path, directory, reference, first=7)


def test_a_missing_holder_differential_share_is_named(tmp_path, hsdp_dir):
    directory = copied(hsdp_dir[1], tmp_path / "run")
    name, index, _, holder = _dependent_diff(directory)
    os.remove(directory / "rank-00000" / holder)
    problems, report = _problems(directory)
    assert problems[f"rank-00000/{holder}"].label == "MISSING"
    why = problems[f"rank-00002/{name}"].why
    assert problems[f"rank-00002/{name}"].label == "HOLDER"
    assert f"share 0 ({directory / 'rank-00000' / holder}), which is missing, holds its gradient chunk" in why, why
    assert dict((step, last) for step, _, last in report.recoverable)[4] == index["first"] - 1
