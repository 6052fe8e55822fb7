"""The guide's torchrun recipe, run for real: ``torchrun --max-restarts 1`` starts two ranks; rank 1
SIGKILLs itself after step 10 on the first attempt; torchrun's agent stops rank 0 and starts both
again (rank 1 joining 3 s after rank 0, as a slow replacement would: with a plain
``init_process_group`` rank 0 then reads the dead rank's address, see lowdiff.init_process_group);
each resumes and trains to the end. Every rank's state at the resumed step and at the end
equals the uninterrupted run's (conftest.py's reference), byte for byte."""
import os
import signal
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from partition_runs import STEPS, WORKER, free_port  # noqa: E402

CRASH_AT = 10


def attempts(path) -> list:
    """The worker's digest lines split by start: [(resumed step, {step: (full, shared)})]."""
    runs: list = []
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "resumed":
                runs.append((int(parts[1]), {int(parts[1]): (parts[2], parts[3])}))
            elif parts[0] != "from-full":
                runs[-1][1][int(parts[0])] = (parts[1], parts[2])
    return runs


def test_torchrun_restarts_the_ranks_after_a_sigkill_and_they_resume_exactly(tmp_path, reference):
    ref, _ = reference
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
               WORKER, "--torchrun", "--steps", str(STEPS), "--dir", str(tmp_path / "ckpt"),
               "--digests", str(tmp_path / "run"), "--crash-at", str(CRASH_AT), "--crash-ranks", "1",
               "--late-restart", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    # Its own process group: on a timeout the agent and its workers go together (killing the agent
    # alone leaves its workers running).
    agent = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        _, stderr = agent.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        pytest.fail(f"torchrun did not finish in 300 s: {agent.communicate()[1][-4000:]}")
    assert agent.returncode == 0, stderr[-4000:]
    for rank in range(2):
        runs = attempts(tmp_path / f"run-{rank}.txt")
        assert len(runs) == 2, f"rank {rank}: {len(runs)} starts, expected the first and one restart"
        (first_start, first), (start, resumed) = runs
        assert first_start == 0
        assert max(first) <= CRASH_AT                  # rank 0 may be stopped short of it
        assert all(digest == ref[rank][step] for step, digest in first.items()), f"rank {rank}: first start"
        assert 0 < start <= CRASH_AT, f"rank {rank} resumed at {start}"
        assert start == attempts(tmp_path / "run-0.txt")[1][0], "ranks resumed at different steps"
        assert resumed[start] == ref[rank][start], f"rank {rank}: state at the resumed step {start} differs"
        assert max(resumed) == STEPS
        for step, digest in resumed.items():
            assert digest == ref[rank][step], f"rank {rank}: state after step {step} differs"
    assert ref[0][STEPS][0] != ref[1][STEPS][0]      # per-rank state differs: equal digests are a real check


def test_outside_torchrun_it_is_init_process_group(tmp_path):
    code = ("import torch, torch.distributed as dist, lowdiff\n"
            "lowdiff.init_process_group('gloo')\n"
            "t = torch.ones(1); dist.all_reduce(t)\n"
            "print(dist.get_rank(), dist.get_world_size(), t.item())\n"
            "dist.destroy_process_group()\n"
            # (torch 2.13 + gloo may abort at interpreter exit after the teardown: docs/guide.md)
            "import os, sys; sys.stdout.flush(); os._exit(0)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "1", "1.0"]
