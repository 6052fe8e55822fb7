"""FSDP2 (fully_shard on each Linear and the root, 2 gloo processes): every rank records its own
DTensor chunks and the local gradient chunk its optimizer consumed; after a SIGKILL of every rank the
restarted job resumes each rank's state (local chunks of parameters and optimizer state, scheduler,
sampler, RNG) byte for byte as the uninterrupted run had it, and trains on identically (issue #31,
items 1-2), and at another world size each new rank's chunks, gathered, are the uninterrupted run's
(item 3). Before, the run failed at its first checkpoint."""
import os
import shutil
import subprocess
import sys

import pytest

import fastio
from lowdiff.format.sharefile import read_full_share_index

sys.path.insert(0, os.path.dirname(__file__))
import partition_runs  # noqa: E402
from partition_runs import free_port  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "fsdp2_worker.py")
STEPS = 10


def launch(directory, digests, world, *extra):
    """Run ``world`` ranks of the FSDP2 worker (partition_runs.launch: one SIGKILLed, all are killed)."""
    return partition_runs.launch(directory, digests, world, *extra, steps=STEPS, worker=WORKER)


def digests(path, column=-1):
    """(resumed step, {step: digest}); ``column`` -2: the gathered digests."""
    resumed, out = None, {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "resumed":
                resumed = int(parts[1])
            out[resumed if parts[0] == "resumed" else int(parts[0])] = parts[column]
    return resumed, out


def ok(results):
    for code, err in results:
        assert code == 0, err
    return "".join(err for _, err in results)


def crashed_run(base, *extra):
    """The uninterrupted run's digests by rank (and, third, rank 0's gathered digests), and a
    directory whose job was SIGKILLed after step 7."""
    ok(launch(base / "ref", base / "ref", 2, *extra))
    reference = [digests(base / f"ref-{rank}.txt")[1] for rank in range(2)] + \
        [digests(base / "ref-0.txt", column=-2)[1]]
    crashed = launch(base / "run", base / "run", 2, "--crash-at", "7", *extra)
    assert [code for code, _ in crashed] == [-9, -9], crashed
    return reference, base / "run"


@pytest.fixture(scope="module")
def dense_adamw(tmp_path_factory):
    """crashed_run with Dense and AdamW, run once; tests copy the directory before changing it."""
    return crashed_run(tmp_path_factory.mktemp("dense-adamw"))


TOPK_SGD = ("--compressor", "topk", "--optimizer", "sgd")


@pytest.fixture(scope="module")
def topk_sgd(tmp_path_factory):
    """crashed_run with TopK and SGD with momentum, run once."""
    return crashed_run(tmp_path_factory.mktemp("topk-sgd"), *TOPK_SGD)


def copied(directory, target):
    subprocess.run(["cp", "-a", str(directory), str(target)], check=True)
    return target


def assert_resumed_exactly(tmp_path, reference, name, lowest=1):
    """Every rank resumed the same step (>= ``lowest``) and matches the reference there and after."""
    resumed = set()
    for rank in range(2):
        step, got = digests(tmp_path / f"{name}-{rank}.txt")
        resumed.add(step)
        assert step >= lowest and sorted(got) == list(range(step, STEPS + 1))
        for s, value in got.items():
            assert value == reference[rank][s], (rank, s)
    assert len(resumed) == 1


# TopK/SGD with -m soak: TopK under FSDP2 is SIGKILLed and resumed by test_fsdp2_hsdp.py, and the
# topk_sgd directory is resumed (at 4 ranks) by the four_ranks test below.
@pytest.mark.parametrize("compressor,optimizer", [("dense", "adamw"),
                                                  pytest.param("topk", "sgd", marks=pytest.mark.soak)])
def test_sigkill_of_every_rank_resumes_exactly(tmp_path, request, compressor, optimizer):
    extra = ("--compressor", compressor, "--optimizer", optimizer)
    reference, directory = request.getfixturevalue(f"{compressor}_{optimizer}")
    directory = copied(directory, tmp_path / "run")
    ok(launch(directory, tmp_path / "res", 2, *extra))
    # full_every 4, batch_steps 2, killed after step 7 without a flush: at least step 4's full set
    # is durable, usually step 6's batch too; the replay of differentials brings it past 4.
    assert_resumed_exactly(tmp_path, reference, "res", lowest=4)


def damage_rank_1s_newest_chunk(directory) -> int:
    """Flip a byte of rank 1's chunk of one weight in its newest full share; that set's step."""
    newest = sorted(n for n in os.listdir(directory / "rank-00001") if n.startswith("full-"))[-1]
    path = str(directory / "rank-00001" / newest)
    with fastio.Reader(path) as reader:
        index = read_full_share_index(path, reader)
    assert "/model/0.weight" in index.dtensors
    (entry,) = [t for t in index.tensors if t.key == "/model/0.weight"]   # rank 1's chunk of it
    with open(path, "r+b") as f:
        f.seek(entry.offset + 5)
        byte = f.read(1)
        f.seek(entry.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    return int(newest.split("-")[1])


@pytest.mark.soak   # drives: killed and resumed by test_partitioned_drives.py (DDP ranks, the same rank directories)
def test_ranks_on_their_drives_killed_and_resumed_exactly(tmp_path, dense_adamw):
    """Options(stripe_dirs=...) under FSDP2 (docs/format.md, "Rank directories on several local
    drives"): rank 1's chunks are written on the other drive, named by rank-00001/DRIVE.json; the job
    SIGKILLed after step 7 resumes there exactly."""
    reference, drives = dense_adamw[0], ("--stripe-dirs", str(tmp_path / "nvme1"))
    crashed = launch(tmp_path / "run", tmp_path / "run", 2, "--crash-at", "7", *drives)
    assert [code for code, _ in crashed] == [-9, -9], crashed
    assert os.listdir(tmp_path / "run" / "rank-00001") == ["DRIVE.json"]
    assert any(n.startswith("full-") for n in os.listdir(tmp_path / "nvme1" / "rank-00001"))
    ok(launch(tmp_path / "run", tmp_path / "res", 2, *drives))
    assert_resumed_exactly(tmp_path, reference, "res", lowest=4)


def test_a_damaged_share_falls_back_to_an_older_set(tmp_path, dense_adamw):
    reference, directory = dense_adamw[0], copied(dense_adamw[1], tmp_path / "run")
    step = damage_rank_1s_newest_chunk(directory)
    err = ok(launch(directory, tmp_path / "res", 2))
    assert f"share 1 of the full checkpoint of step {step}" in err and "falling back" in err, err
    assert "resumed from the older full checkpoint" in err and "ends at" not in err, err
    assert_resumed_exactly(tmp_path, reference, "res", lowest=step)   # from the older set, replayed past it


def resume_at(tmp_path, directory, world, *extra):
    """Resume a copy of ``directory`` with ``world`` ranks (no training): (step, gathered digest) by rank."""
    directory = copied(directory, tmp_path / f"run{world}")
    ok(launch(directory, tmp_path / f"at{world}", world, "--resume-only", *extra))
    return [digests(tmp_path / f"at{world}-{rank}.txt", column=-2) for rank in range(world)]


def check_resharded(reference_gathered, resumed):
    steps = {step for step, _ in resumed}
    assert len(steps) == 1 and steps.pop() >= 4, resumed   # past the full set: differentials replayed
    for step, got in resumed:
        assert got[step] == reference_gathered[step]


def test_a_damaged_chunk_of_another_rank_falls_back_when_resharding(tmp_path, dense_adamw):
    """At another world size a rank reads every share's chunks: a damaged one is found before the
    state is rebuilt, and the resume falls back to the older set with a warning, exact (it raised
    a CorruptCheckpointError out of resume instead)."""
    reference, directory = dense_adamw[0], copied(dense_adamw[1], tmp_path / "run")
    step = damage_rank_1s_newest_chunk(directory)
    directory = copied(directory, tmp_path / "run1")
    results = launch(directory, tmp_path / "at1", 1, "--resume-only")
    err = ok(results)
    assert f"share 1 of the full checkpoint of step {step}" in err and "falling back" in err, err
    resumed, got = digests(tmp_path / "at1-0.txt", column=-2)
    assert resumed >= step - 4 and got[resumed] == reference[2][resumed], (resumed, err)


def test_resume_at_one_rank_gathers_to_the_uninterrupted_state(tmp_path, dense_adamw):
    """Issue #31, item 3: each new rank reads the overlapping pieces of the old shards (full set and
    every differential) and replays its own chunk; the state gathered to full tensors is the
    uninterrupted run's, byte for byte (AdamW works element by element)."""
    reference, directory = dense_adamw
    check_resharded(reference[2], resume_at(tmp_path, directory, 1))


@pytest.mark.four_ranks
def test_resume_at_four_ranks_gathers_to_the_uninterrupted_state(tmp_path, topk_sgd):
    """2 -> 4 ranks with TopK and SGD with momentum: the recorded chunks are cut into four uneven ones
    (the last Linear has 5 rows: chunks of 2, 2, 1 and 0 rows)."""
    reference, directory = topk_sgd
    check_resharded(reference[2], resume_at(tmp_path, directory, 4, *TOPK_SGD))


def test_a_non_elementwise_optimizer_is_refused_at_another_world_size(tmp_path):
    """An optimizer lowdiff does not know to work element by element (a user's own class) is refused
    when the chunks change, never resumed differently."""
    extra = ("--optimizer", "own")
    directory = tmp_path / "run"
    ok(launch(directory, tmp_path / "run", 2, *extra))
    result = subprocess.run([sys.executable, WORKER, "--rank", "0", "--world", "1", "--port", str(free_port()),
                             "--steps", str(STEPS), "--dir", str(directory), "--digests", str(tmp_path / "one"),
                             "--resume-only", *extra], capture_output=True, text=True, timeout=180)
    assert result.returncode != 0
    assert "IncompatibleCheckpointError" in result.stderr and "__main__.OwnSGD" in result.stderr
    assert "element by element" in result.stderr and "world size it was written with" in result.stderr


def test_export_of_a_sharded_directory_writes_the_gathered_state(tmp_path, dense_adamw):
    """``python -m lowdiff export`` (one process, no process group) gathers every share's chunks into
    whole tensors and replays whole gradients cut from the shares' records: what it writes equals
    the uninterrupted run's state gathered at that step, for the full set's step and past it."""
    import torch
    from fsdp2_worker import gathered_of

    reference, directory = dense_adamw
    for step in (4, 5):
        out = tmp_path / f"export-{step}.pt"
        subprocess.run([sys.executable, "-m", "lowdiff", "export", str(directory), "--step", str(step), "-o", str(out)],
                       check=True, capture_output=True, text=True, timeout=180)
        state = torch.load(out, weights_only=True)
        assert state["step"] == step
        opt = state["optimizer"]
        assert gathered_of(state["model"], opt["state"], opt["param_groups"]) == reference[2][step]


# 5 with -m soak: test_fsdp2_directory.py travels to 5 (from step 4's set, a newer one kept) by default.
@pytest.mark.parametrize("step", [3, pytest.param(5, marks=pytest.mark.soak)])
def test_time_travel_to_an_earlier_step_of_a_sharded_directory(tmp_path, dense_adamw, step):
    """resume(..., step=K) on a sharded directory: every rank's state is the uninterrupted run's at
    K, inside a set's chain (3: from the set of step 0) and past a newer set (5: from step 4's)."""
    reference, directory = dense_adamw
    name = f"travel{step}"
    ok(launch(copied(directory, tmp_path / name), tmp_path / name, 2, "--resume-only", "--resume-step", str(step)))
    for rank in range(2):
        resumed, got = digests(tmp_path / f"{name}-{rank}.txt")
        assert resumed == step and got[step] == reference[rank][step], (step, rank)


def test_a_tied_weight_is_stored_once_and_resumed_exactly(tmp_path):
    """A weight tied to another module's (one DTensor under two state-dict names, as a language
    model's head and embedding) is one chunk in each share, and the resume is exact."""
    reference, directory = crashed_run(tmp_path, "--tied")
    path = str(directory / "rank-00001" / sorted(n for n in os.listdir(directory / "rank-00001")
                                                 if n.startswith("full-"))[-1])
    with fastio.Reader(path) as reader:
        keys = [t.key for t in read_full_share_index(path, reader).tensors]
    assert "/model/embed.weight" in keys and "/model/head.weight" not in keys
    ok(launch(directory, tmp_path / "res", 2, "--tied"))
    assert_resumed_exactly(tmp_path, reference, "res", lowest=4)


def test_a_sharded_run_drains_to_a_shared_tier_and_resumes_from_it_alone(tmp_path, dense_adamw):
    """Tiers on an FSDP2 directory (issue #31, item 6): each rank drains its share of every set
    into the shared tier; with the local tier lost, both ranks resume from the shared tier alone at
    the last step, exactly; `verify` passes on the shared tier."""
    reference, shared = dense_adamw[0], tmp_path / "shared"
    ok(launch(tmp_path / "local", tmp_path / "run", 2, "--shared", str(shared)))
    for rank in range(2):
        assert digests(tmp_path / f"run-{rank}.txt")[1] == reference[rank]   # tiers change nothing
    shutil.rmtree(tmp_path / "local")                                         # the node is lost
    ok(launch(tmp_path / "local", tmp_path / "res", 2, "--shared", str(shared), "--resume-only"))
    for rank in range(2):
        step, got = digests(tmp_path / f"res-{rank}.txt")
        assert step == STEPS and got[STEPS] == reference[rank][STEPS], rank
    checked = subprocess.run([sys.executable, "-m", "lowdiff", "verify", str(shared)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
