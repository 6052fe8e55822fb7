"""HSDP: FSDP2 on a 2-D (replicate, shard) mesh of 4 gloo processes, placements (Replicate(),
Shard(0)) (issue #31, item 1's 2-D mesh case). The two ranks of a replicate group hold the same
chunks and consume the same gradient chunks: each chunk is written by one of them, the other names it
(docs/format.md, "2-D meshes"); after a SIGKILL of every rank the job resumes at the same mesh (a rank
reading the chunks its group's other rank wrote) with each rank's state byte for byte the uninterrupted run's,
and trains on identically; at another world size and mesh (2 ranks, 1-D FSDP2) the state, gathered,
is the uninterrupted run's. Before, wrap() refused the model ("a DTensor on a 2-D mesh")."""
import math
import os
import subprocess
import sys

import pytest

import fastio
from lowdiff.format.sharefile import read_diff_share_index, read_full_share_index, read_own

sys.path.insert(0, os.path.dirname(__file__))
import partition_runs  # noqa: E402
from test_fsdp2_resume import WORKER, copied, digests, ok  # noqa: E402

STEPS = 8
HSDP = ("--hsdp", "--compressor", "topk", "--optimizer", "adamw")

pytestmark = pytest.mark.four_ranks


def launch(directory, name, world, *extra):
    return partition_runs.launch(directory, name, world, *extra, steps=STEPS, worker=WORKER)


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    """The uninterrupted 4-rank HSDP run's digests by rank (and, fifth, rank 0's gathered ones), and
    a directory whose job was SIGKILLed after step 7 (full_every 4, batch_steps 2: step 4's full set
    at least is durable)."""
    base = tmp_path_factory.mktemp("hsdp")
    ok(launch(base / "ref", base / "ref", 4, *HSDP))
    reference = [digests(base / f"ref-{rank}.txt")[1] for rank in range(4)] + \
        [digests(base / "ref-0.txt", column=-2)[1]]
    crashed = launch(base / "run", base / "run", 4, *HSDP, "--crash-at", "7")
    assert [code for code, _ in crashed] == [-9] * 4, crashed
    return reference, base / "run"


def _share(directory, rank: int, name: str) -> tuple:
    """(index, {key: (chunk entry, bytes)} of the chunks it holds) of rank ``rank``'s full share ``name``."""
    path = str(directory / f"rank-{rank:05d}" / name)
    with fastio.Reader(path) as reader:
        index = read_full_share_index(path, reader)
        own, _ = read_own(path, reader, index)
    return index, {key: (index.dtensors[key], bytes(own[key][1])) for key in index.dtensors if key in own}


GROUPS = ((0, 2), (1, 3))   # the replicate groups: the columns of the (2, 2) mesh


def test_each_chunk_is_written_once_and_the_directory_verifies(hsdp_run):
    """docs/format.md, "2-D meshes": of the two ranks of a replicate group, which hold the same
    chunks, one writes each chunk and the other names it in `elsewhere` (with an equal chunk entry);
    the DTensor bytes of a full set are those of the state once, and each differential share of a
    group records the gradient chunks of different parameters. `verify` accepts the directory.
    Before, both ranks of a group wrote every chunk (twice the state on disk)."""
    _, directory = hsdp_run
    name = sorted(n for n in os.listdir(directory / "rank-00000") if n.startswith("full-"))[-1]
    shares = [_share(directory, rank, name) for rank in range(4)]
    entry = shares[0][0].dtensors["/model/0.weight"]
    assert entry["mesh_shape"] == [2, 2] and entry["mesh_dim_names"] == ["replicate", "shard"]
    assert entry["placements"] == ["R", "S0"] and entry["global_shape"] == [24, 8]
    for a, b in GROUPS:
        (index_a, held_a), (index_b, held_b) = shares[a], shares[b]
        assert index_a.dtensors == index_b.dtensors   # the same chunks...
        assert held_a and held_b and not set(held_a) & set(held_b)   # ...each written by one of them
        assert set(held_a) | set(held_b) == set(index_a.dtensors)
        assert {k: e["share"] for k, e in index_a.elsewhere.items()} == dict.fromkeys(held_b, b)
        assert {k: e["share"] for k, e in index_b.elsewhere.items()} == dict.fromkeys(held_a, a)
    assert [shares[rank][0].dtensors["/model/0.weight"]["offsets"] for rank in range(4)] == [[0, 0], [12, 0]] * 2
    # One copy: the chunks on disk add up to every DTensor's global size, once.
    whole = {key: math.prod(e["global_shape"]) for key, e in shares[0][0].dtensors.items()}
    on_disk = {key: 0 for key in whole}
    for _, held in shares:
        for key, (e, data) in held.items():
            assert len(data) == 4 * math.prod(e["shape"])   # float32 chunks
            on_disk[key] += math.prod(e["shape"])
    assert on_disk == whole
    diffs = []
    for rank in range(4):
        newest = sorted(n for n in os.listdir(directory / f"rank-{rank:05d}") if n.startswith("diff-"))[-1]
        diffs.append(read_diff_share_index(str(directory / f"rank-{rank:05d}" / newest)))
    for a, b in GROUPS:
        slots = set(diffs[a].dtensors)
        recorded_a, recorded_b = slots & set(diffs[a].slots), slots & set(diffs[b].slots)
        assert recorded_a and recorded_b and not recorded_a & recorded_b and recorded_a | recorded_b == slots
        assert diffs[a].elsewhere == dict.fromkeys(recorded_b, b) and diffs[b].elsewhere == dict.fromkeys(recorded_a, a)
    checked = subprocess.run([sys.executable, "-m", "lowdiff", "verify", str(directory)], capture_output=True,
                             text=True, timeout=180)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    inspected = subprocess.run([sys.executable, "-m", "lowdiff", "inspect", str(directory)], capture_output=True,
                               text=True, timeout=180)
    assert inspected.returncode == 0, inspected.stderr
    held_by_0 = len(shares[2][0].elsewhere)
    assert f"share 2 of 4: {len(shares[2][0].tensors)} own tensors ({len(shares[2][1])} of them DTensor chunks), " \
           f"{held_by_0} chunk{'s' * (held_by_0 > 1)} in share 0" in inspected.stdout, inspected.stdout


def test_sigkill_of_every_rank_resumes_exactly_at_the_same_mesh(tmp_path, hsdp_run):
    reference, directory = hsdp_run
    ok(launch(copied(directory, tmp_path / "run"), tmp_path / "res", 4, *HSDP))
    resumed = set()
    for rank in range(4):
        step, got = digests(tmp_path / f"res-{rank}.txt")
        resumed.add(step)
        assert step >= 4 and sorted(got) == list(range(step, STEPS + 1))
        for s, value in got.items():
            assert value == reference[rank][s], (rank, s)
    assert len(resumed) == 1


def test_a_damaged_chunk_named_by_another_share_falls_back_to_an_older_set(tmp_path, hsdp_run):
    """One copy of each chunk: damaged where it is written, the share that names it cannot be
    resumed either; every rank falls back to the older full set (with a warning naming the share)
    and replays its differentials, exactly."""
    reference, directory = hsdp_run
    directory = copied(directory, tmp_path / "run")
    name = sorted(n for n in os.listdir(directory / "rank-00002") if n.startswith("full-"))[-1]
    index, _ = _share(directory, 2, name)
    key = next(key for key, where in index.elsewhere.items() if where["share"] == 0)
    path = directory / "rank-00000" / name
    with fastio.Reader(str(path)) as reader:
        (entry,) = [t for t in read_full_share_index(str(path), reader).tensors if t.key == key]
    with open(path, "r+b") as f:
        f.seek(entry.offset + 3)
        byte = f.read(1)
        f.seek(entry.offset + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    step = int(name.split("-")[1])
    err = ok(launch(directory, tmp_path / "res", 4, *HSDP))
    assert f"share 0 of the full checkpoint of step {step}" in err and "falling back" in err, err
    for rank in range(4):
        resumed, got = digests(tmp_path / f"res-{rank}.txt")
        assert resumed >= step and sorted(got) == list(range(resumed, STEPS + 1)), (rank, resumed)
        for s, value in got.items():
            assert value == reference[rank][s], (rank, s)


def test_resume_at_two_ranks_on_a_1d_mesh_gathers_to_the_uninterrupted_state(tmp_path, hsdp_run):
    """HSDP (2 x 2) -> FSDP2 on 2 ranks: each new chunk is cut from the recorded ones (a replicate
    group's duplicates overlap with equal bytes), full set and every differential; gathered, the
    state is the uninterrupted run's at the durable step (AdamW works element by element)."""
    reference, directory = hsdp_run
    extra = [a for a in HSDP if a != "--hsdp"]
    ok(launch(copied(directory, tmp_path / "run2"), tmp_path / "at2", 2, "--resume-only", *extra))
    resumed = [digests(tmp_path / f"at2-{rank}.txt", column=-2) for rank in range(2)]
    steps = {step for step, _ in resumed}
    assert len(steps) == 1 and steps.pop() >= 4, resumed
    for step, got in resumed:
        assert got[step] == reference[4][step]


def test_export_to_dcp_writes_each_chunk_once_and_loads_at_two_ranks(tmp_path, hsdp_run):
    """``export --format dcp`` of the HSDP directory: each chunk once (a replicate group's copies are
    the same bytes), and ``dcp.load`` into a 2-rank 1-D FSDP2 model gives the uninterrupted run's
    state at that step. Before, share 2 and 3 wrote their copies again."""
    from test_fsdp2_dcp import chunks_of, launch_dcp, lines

    reference, directory = hsdp_run
    out = tmp_path / "exported"
    result = subprocess.run([sys.executable, "-m", "lowdiff", "export", str(directory), "--step", "5",
                             "--format", "dcp", "-o", str(out)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    chunks = chunks_of(out)
    assert chunks["0.weight"] == [([0, 0], [12, 8]), ([12, 0], [12, 8])]
    assert chunks["state.3.weight.exp_avg"] == [([0, 0], [3, 24]), ([3, 0], [2, 24])]
    ok(launch_dcp(out, tmp_path / "load", 2, "--load-only"))
    for rank in range(2):
        (loaded,) = lines(tmp_path / f"load-{rank}.txt")
        assert loaded == ["loaded", "5", reference[4][5]], rank
