"""SIGKILL campaigns (issue #33, coverage), not a test module:

* ``auto_kill``: a trainer with ``full_every``/``batch_steps`` "auto" (killed_trainer.py) SIGKILLs
  itself at a random crash point (``LOWDIFF_FAULT``, the controller's CONTROLLER.json write
  included); an in-process resume must reach the step it reported durable, exactly, and a restarted
  trainer must train on to the uninterrupted run's states;
* ``torchrun_kill``: ``torchrun --max-restarts 1`` runs 2 DDP ranks (gloo) with storage tiers or in
  replica mode; on the first start one rank SIGKILLs itself at a random crash point
  (first_attempt.py); torchrun restarts both, which resume and train to the end. Every rank's
  state at the resumed step and after is the uninterrupted run's; the resumed step is at least
  the last step both ranks had flushed before the kill.

Each returns a ``Kill``: whether the fault fired, the resumes checked and how they came out.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "distributed"))

from lowdiff_helpers import build  # noqa: E402
from partition_runs import STEPS as DDP_STEPS  # noqa: E402
from partition_runs import WORKER  # noqa: E402

import recovery  # noqa: E402
from lowdiff import faults  # noqa: E402
from lowdiff.cli.demo import state_digest  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
TIMEOUT_S = 300   # against hangs only
AUTO_PHASES = faults.PHASES + faults.CONTROL_PHASES
TIER_PHASES = faults.PHASES + faults.TIER_PHASES


@dataclasses.dataclass
class Kill:
    where: str
    killed: bool = False
    resumes: int = 0
    exact: int = 0
    below: int = 0
    wrong: int = 0
    problems: list = dataclasses.field(default_factory=list)

    def resume(self, step: int, required: int, same: bool, what: str) -> None:
        self.resumes += 1
        if step < required:
            self.below += 1
            self.problems.append(f"{self.where}: {what} resumed at {step}, {required} was durable")
        elif not same:
            self.wrong += 1
            self.problems.append(f"{self.where}: {what} resumed at {step} with another state")
        else:
            self.exact += 1


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOWDIFF_FAULT", "TORCHELASTIC_RESTART_COUNT")}
    env.update(PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", **extra)
    return env


def _lines(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.split() for line in f if line.endswith("\n")]


def _resumed_here(directory: str) -> tuple[int, str]:
    """(step, digest) of an in-process resume into fresh objects (RNGs moved first, unless nothing
    is restored: then the objects as built are the state of step 0)."""
    model, opt, sched, sampler = build()
    torch.manual_seed(4321)
    np.random.seed(4321)
    step = recovery.resume(directory, model, opt, scheduler=sched, extra_state={"sampler": sampler})
    if step == 0 and step.full_step < 0:
        model, opt, sched, sampler = build()
    return int(step), state_digest(model, opt, sched, sampler)


def auto_kill(work: str, settings: str, phase: str, count: int, steps: int, reference: dict) -> Kill:
    kill = Kill(f"{settings} settings, SIGKILL at {phase}:{count}")
    directory, out = os.path.join(work, "ckpt"), os.path.join(work, "out.txt")
    command = [sys.executable, os.path.join(HERE, "killed_trainer.py"), directory, settings, str(steps), out]
    first = subprocess.run(command, env=_env(LOWDIFF_FAULT=f"{phase}:{count}"), capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    if first.returncode not in (0, -signal.SIGKILL):
        kill.problems.append(f"{kill.where}: the trainer failed ({first.returncode}): {first.stderr[-2000:]}")
        return kill
    kill.killed = first.returncode == -signal.SIGKILL
    required = max([int(parts[1]) for parts in _lines(out) if parts[0] != "resumed"], default=-1)
    step, digest = _resumed_here(directory)
    kill.resume(step, required, digest == reference[step], "an in-process resume")
    again = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
    if again.returncode != 0:
        kill.problems.append(f"{kill.where}: the restarted trainer failed: {again.stderr[-2000:]}")
        return kill
    lines = _lines(out)
    start = max(i for i, parts in enumerate(lines) if parts[0] == "resumed")
    resumed = int(lines[start][1])
    kill.resume(resumed, required, lines[start][2] == reference[resumed], "the restarted trainer")
    after = lines[start + 1:]
    if [int(p[0]) for p in after] != list(range(resumed + 1, steps + 1)) or \
            any(p[2] != reference[int(p[0])] for p in after):
        kill.wrong += 1
        kill.problems.append(f"{kill.where}: the restarted trainer's steps differ from the uninterrupted run")
    return kill


def ddp_reference(work: str, compressor: str) -> list:
    """[{step: (full digest, shared digest)}] by rank of an uninterrupted 2-rank run."""
    from partition_runs import digests, launch, ok

    ok(launch(os.path.join(work, "ckpt"), os.path.join(work, "ref"), 2, "--compressor", compressor, "--flush"))
    return [digests(os.path.join(work, f"ref-{rank}.txt"))[1] for rank in range(2)]


def _attempts(path: str) -> list:
    runs: list = []
    for parts in _lines(path):
        if parts[0] == "resumed":
            runs.append((int(parts[1]), {int(parts[1]): (parts[2], parts[3])}))
        elif parts[0] != "from-full" and runs:
            runs[-1][1][int(parts[0])] = (parts[1], parts[2])
    return runs


def torchrun_kill(work: str, mode: str, phase: str, count: int, rank: int, reference: list) -> Kill:
    """``mode``: "tiers" (TopK, a shared tier) or "replica" (Dense, replica mode)."""
    kill = Kill(f"torchrun DDP with {mode}, rank {rank} SIGKILLed at {phase}:{count}")
    extra = ["--shared-dir", os.path.join(work, "shared")] if mode == "tiers" else ["--replica", "--compressor",
                                                                                    "dense"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
               "2", "--max-restarts", "1", "--monitor-interval", "0.2", os.path.join(HERE, "first_attempt.py"),
               WORKER, "--torchrun", "--steps", str(DDP_STEPS), "--dir", os.path.join(work, "ckpt"),
               "--digests", os.path.join(work, "run"), "--flush", *extra]
    env = _env(FIRST_ATTEMPT_RANK=str(rank), FIRST_ATTEMPT_FAULT=f"{phase}:{count}")
    agent = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        _, stderr = agent.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(agent.pid, signal.SIGKILL)
        kill.problems.append(f"{kill.where}: torchrun hung: {agent.communicate()[1][-20000:]}")
        return kill
    if agent.returncode != 0:
        kill.problems.append(f"{kill.where}: torchrun failed ({agent.returncode}): {stderr[-20000:]}")
        return kill
    runs = [_attempts(os.path.join(work, f"run-{r}.txt")) for r in range(2)]
    kill.killed = len(runs[0]) == 2
    # --flush: a step line is written after flush() returned, so every step a rank printed was durable.
    required = min(max(runs[r][0][1]) for r in range(2)) if kill.killed else 0
    for r in range(2):
        start, states = runs[r][-1]
        if kill.killed:
            kill.resume(start, required, states[start] == reference[r][start], f"rank {r}")
        if max(states) != DDP_STEPS or any(d != reference[r][s] for s, d in states.items()):
            kill.wrong += 1
            kill.problems.append(f"{kill.where}: rank {r}'s states after the restart differ from the uninterrupted run")
    return kill
