"""The partitioned workload of the crash-state explorer (not a test module): a 2-rank DDP run
(gloo, tests/distributed/partition_worker.py) writing a share per rank, each rank traced in its own
process; the two traces are merged by the system-wide monotonic clock into one program (a power
loss takes both ranks' unsynced writes at once, as on one node).

A crash state is checked by resuming it in one process (another world size: every share is read)
into a plain optimizer: the parameters and optimizer state (what is the same on every rank) must be
the uninterrupted run's at the resumed step, which is at least the lowest step the two ranks
reported durable. A later 2-rank session on a sample of the states trains to the end and must land
exactly on the uninterrupted run's last state.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import torch
from checker import Outcome
from explore import HERE, REPO, TIMEOUT_S

sys.path.insert(0, os.path.join(os.path.dirname(HERE), "distributed"))
import forkserver  # noqa: E402
import partition_worker  # noqa: E402
from partition_runs import digests, free_port  # noqa: E402

import recovery  # noqa: E402

STEPS = 6
SETTINGS = ["--full-every", "3", "--batch-steps", "2", "--flush"]


def launch(root: str, out: str, *, traced: bool, steps: int = STEPS) -> None:
    """Run the 2 ranks on ``root``/ckpt (traced: each into ``out``-RANK.pkl); digests to ``out``-RANK.txt."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LOWDIFF_FAULT", None)
    procs = []
    for rank in range(2):
        worker = [os.path.join(os.path.dirname(HERE), "distributed", "partition_worker.py"), "--rank", str(rank),
                  "--world", "2", "--port", str(port), "--steps", str(steps), "--dir", os.path.join(root, "ckpt"),
                  "--digests", f"{out}-{rank}.txt", *SETTINGS]
        prefix = [os.path.join(HERE, "traced.py"), root, f"{out}-{rank}.pkl"] if traced else []
        # untraced: forked with torch already imported (the tracer needs a fresh interpreter)
        procs.append(forkserver.start([sys.executable, *prefix, *worker], env) if not traced else
                     subprocess.Popen([sys.executable, *prefix, *worker], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    errors = [p.communicate(timeout=TIMEOUT_S)[1] for p in procs]
    for p, err in zip(procs, errors):
        if p.returncode != 0:
            raise AssertionError(f"a rank failed ({p.returncode}):\n{err}")


def resumed_shared(root: str) -> tuple[int, str]:
    """(step, digest of parameters and optimizer state) of a 1-process resume of ``root``/ckpt."""
    return resumed_shared_at(os.path.join(root, "ckpt"))


def resumed_shared_at(directory: str) -> tuple[int, str]:
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)   # as the worker's
    np.random.seed(4321)
    step = recovery.resume(directory, model, opt, scheduler=sched)
    return int(step), partition_worker.shared_digest(model, opt)


def check(root: str, required: int, reference: dict, work_dir: str, later: bool) -> Outcome:
    """``reference``: {step: shared digest} of the uninterrupted run (the traced one)."""
    try:
        step, digest = resumed_shared(root)
    except Exception as exc:
        return Outcome("error", -1, f"resume raised {type(exc).__name__}: {exc}")
    if step < required:
        return Outcome("below", step, f"resumed at {step}, {required} was reported durable by both ranks")
    if digest != reference[step]:
        return Outcome("wrong", step, f"resumed at {step} with a state unlike the uninterrupted run's")
    if later:
        try:
            launch(root, os.path.join(work_dir, "later"), traced=False)
            final, digest = resumed_shared(root)
        except Exception as exc:
            return Outcome("later", step, f"a later 2-rank session failed: {exc}")
        if final != STEPS or digest != reference[STEPS]:
            return Outcome("later", step, f"a later 2-rank session trained to {STEPS}, resume then gave {final} "
                                          f"({'exact' if digest == reference.get(final) else 'not exact'})")
    return Outcome("exact", step)


def reference_of(out: str) -> dict:
    """{step: shared digest} of rank 0 of the traced run (the same on every rank: checked)."""
    ranks = [digests(f"{out}-{rank}.txt")[1] for rank in range(2)]
    shared = {step: pair[1] for step, pair in ranks[0].items()}
    assert shared == {step: pair[1] for step, pair in ranks[1].items()}, "the ranks' shared states differ"
    return shared
