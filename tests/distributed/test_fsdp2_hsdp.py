"""HSDP: FSDP2 on a 2-D (replicate, shard) mesh of 4 gloo processes, placements (Replicate(),
Shard(0)) (issue #31, item 1's 2-D mesh case). Every rank records its own local chunks and local
gradient chunk, so the two ranks of a replicate group write the same chunks; after a SIGKILL of every
rank the job resumes at the same mesh with each rank's state byte for byte the uninterrupted run's,
and trains on identically; at another world size and mesh (2 ranks, 1-D FSDP2) the state, gathered,
is the uninterrupted run's. Before, wrap() refused the model ("a DTensor on a 2-D mesh")."""
import os
import subprocess
import sys

import pytest

import fastio
from lowdiff.format.sharefile import read_full_share_index, read_own

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


def _chunks(directory, rank: int, name: str) -> dict:
    """{key: (chunk entry, bytes)} of rank ``rank``'s share of the full set ``name``."""
    path = str(directory / f"rank-{rank:05d}" / name)
    with fastio.Reader(path) as reader:
        index = read_full_share_index(path, reader)
        own, _ = read_own(path, reader, index)
    return {key: (entry, bytes(own[key][1])) for key, entry in index.dtensors.items()}


def test_replicas_write_the_same_chunks_and_verify(hsdp_run):
    """Each rank's share holds its own chunks on the 2-D mesh; the ranks of one replicate group
    (0 and 2, 1 and 3: the mesh's columns) hold the same chunk entries and bytes, the two ranks of a
    row different pieces of each tensor. `verify` accepts the directory."""
    _, directory = hsdp_run
    name = sorted(n for n in os.listdir(directory / "rank-00000") if n.startswith("full-"))[-1]
    shares = [_chunks(directory, rank, name) for rank in range(4)]
    assert "/model/0.weight" in shares[0]
    entry = shares[0]["/model/0.weight"][0]
    assert entry["mesh_shape"] == [2, 2] and entry["mesh_dim_names"] == ["replicate", "shard"]
    assert entry["placements"] == ["R", "S0"] and entry["global_shape"] == [24, 8]
    assert shares[0] == shares[2] and shares[1] == shares[3]
    assert [shares[rank]["/model/0.weight"][0]["offsets"] for rank in range(4)] == [[0, 0], [12, 0]] * 2
    checked = subprocess.run([sys.executable, "-m", "lowdiff", "verify", str(directory)], capture_output=True,
                             text=True, timeout=180)
    assert checked.returncode == 0, checked.stdout + checked.stderr


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
