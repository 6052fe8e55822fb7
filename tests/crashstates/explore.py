"""The crash-state explorer's driver (not a test module): trace a workload in a real process, then
build and check the states a power loss at each barrier could leave (fsmodel.py, checker.py).

``explore(name, work_dir, samples, limit, seed)`` returns a ``Report``: how many crash points and
states were built and checked, and every state that failed (with how it was built).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import subprocess
import sys

import fsmodel
import numpy as np
import torch
import tracer

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TIMEOUT_S = 300   # against hangs only


@dataclasses.dataclass
class Report:
    workload: str
    ops: int = 0
    points: int = 0
    built: int = 0
    checked: int = 0
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    failures: list = dataclasses.field(default_factory=list)

    def line(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))
        return (f"{self.workload}: {self.ops} ops, {self.points} crash points, {self.built} states built, "
                f"{self.checked} checked ({kinds})")


def trace(script: str, args: list, root: str, trace_path: str) -> list:
    """Run ``script`` under the tracer in a fresh process; its trace."""
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("LOWDIFF_FAULT", None)
    done = subprocess.run([sys.executable, os.path.join(HERE, "traced.py"), root, trace_path, script, *args],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if done.returncode != 0:
        raise AssertionError(f"traced workload failed ({done.returncode}):\n{done.stderr}")
    return tracer.load(trace_path)


def check_complete(program: fsmodel.Program, root: str) -> None:
    """Replaying the whole trace must give the directory the process left: nothing untraced."""
    end = fsmodel.durability(program, len(program.ops))
    replayed = fsmodel.build(program, end, end.total_meta, {i: None for i in end.pending_data}, "replay")
    real = fsmodel.snapshot(root)
    if replayed.key() != real.key():
        raise AssertionError(f"the trace is incomplete: replayed {sorted(replayed.files)}, "
                             f"on disk {sorted(real.files)}")


def candidates(program: fsmodel.Program, samples: int, seed: int, model: str = "journal"):
    """(crash point, state) for every crash point, each state unique by content across points."""
    rng = np.random.default_rng(seed)
    seen: set = set()
    for point in program.barriers():
        for state in fsmodel.states(program, point, rng, samples, model):
            key = state.key()
            if key not in seen:
                seen.add(key)
                yield point, state


def kind_of(state) -> str:
    """How a state was built (fsmodel.states): a prefix of the directory operations with no or all
    pending data, a random sample (some pending writes kept, some torn), or a per-directory sample."""
    for kind in ("per-directory", "sample"):
        if state.how.startswith(kind):
            return kind
    return state.how.rsplit(", ", 1)[-1]


def pick(built: list, limit: int, seed: int) -> list:
    """``limit`` of the (crash point, state) pairs, drawn with ``seed`` in turn from each kind of
    state (kind_of), so that a small sample still holds every kind the workload built."""
    rng = np.random.default_rng(seed)
    by_kind: dict = collections.defaultdict(list)
    for i, (_, state) in enumerate(built):
        by_kind[kind_of(state)].append(i)
    queues = [list(rng.permutation(by_kind[kind])) for kind in sorted(by_kind)]
    picks: list = []
    while len(picks) < limit:
        for queue in queues:
            if queue and len(picks) < limit:
                picks.append(int(queue.pop()))
    return [built[i] for i in sorted(picks)]


def explore(name: str, work_dir: str, *, samples: int, limit: int | None, seed: int, check,
            model: str = "journal") -> Report:
    """Trace workload ``name`` under ``work_dir`` and check its crash states with ``check(root,
    required, state) -> checker.Outcome``. ``limit``: check at most that many states, drawn with
    ``seed`` from all that were built (None: all); ``model``: fsmodel's persistence model. The
    "partitioned" workload runs 2 ranks (partitioned.py); the others one process (workload.py)."""
    root = os.path.join(work_dir, "root")
    os.makedirs(root)
    report = Report(name)
    if name == "partitioned":
        import partitioned

        out = os.path.join(work_dir, "run")
        partitioned.launch(root, out, traced=True)
        program = fsmodel.resolve([tracer.load(f"{out}-{rank}.pkl") for rank in range(2)])
    else:
        program = fsmodel.resolve([trace(os.path.join(HERE, "workload.py"), [name, root], root,
                                         os.path.join(work_dir, "trace.pkl"))])
    check_complete(program, root)
    report.ops, report.points = len(program.ops), len(program.barriers())
    built = list(candidates(program, samples, seed, model))
    report.built = len(built)
    chosen = built if limit is None or limit >= len(built) else pick(built, limit, seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # as the traced process: the digests depend on the thread count
    log = logging.getLogger("lowdiff")
    level = log.level
    log.setLevel(logging.ERROR)   # fallbacks are expected on these states; the outcomes are checked
    try:
        for point, state in chosen:
            fsmodel.materialize(state, root)
            required = program.required_step(point)
            outcome = check(root, required, state)
            report.checked += 1
            report.outcomes[outcome.kind] += 1
            if outcome.kind != "exact":
                barrier = program.ops[point][0] if point < len(program.ops) else "end"
                report.failures.append(f"{name} crash point {point} ({barrier}, durable {required}), "
                                       f"{state.how}: {outcome.detail}")
    finally:
        torch.set_num_threads(threads)
        log.setLevel(level)
    return report
