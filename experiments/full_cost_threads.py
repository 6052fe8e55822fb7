"""Where does a full checkpoint's cost to the iterations go? CPU time per thread, per iteration.

Issue #32: on a machine whose cores all train (2 cores here, torch using both), a full checkpoint
costs the whole iterations several copies of the state, while the training thread waits in
``step()`` less than one copy. This script trains the quick GPT with lowdiff TopK(0.01) and a full
checkpoint every ``--full-every`` steps, and after every iteration reads, for every thread of the
process, the CPU time it ran and the time it waited for a CPU (``/proc/self/task/*/schedstat``,
nanoseconds). Threads are grouped by what they do:

  training      the main thread (forward, backward, opt.step())
  intra-op      torch's own worker threads (not Python threads: every native thread not below)
  lowdiff       Python threads whose name starts with lowdiff- or fastio- (copy, CRC, write, commit)
  io_uring      the kernel's io_uring workers of this process (iou-wrk-*, iou-sqp-*)

and, outside the process, the CPU every other task of the machine used (``/proc/stat`` busy time
minus this process's, 10 ms jiffies: a sum over many iterations, not one). Iterations are classed
by their distance from the last full checkpoint (0: the step that takes it, 1: the next, ...), and
the table prints per class the median wall time, the median CPU time of each group, the time the
training and torch's threads waited for a CPU ("wait"), and the time the training thread slept
(wall - its CPU - its wait: on the GIL, on torch's workers, on a lock), for the first half of the
cycle, against a baseline: the second half's iterations pooled (a persist is long over by then).
"others cpu" is too coarse per iteration (jiffies): it only says whether the machine was quiet.
What a checkpoint adds to the
iterations and what CPU it adds, side by side, say whether the cost is CPU the training threads
lose to our threads (a machine with no spare core pays it in wall time) or something else
(waiting, page faults, memory bandwidth: then wall grows more than CPU).

``--phases`` also times the full writer's phases on its thread (copy, write + fsync, manifest +
retention) by wrapping those methods. ``--policies normal,idle-copy,idle-threads`` alternates, cycle
by cycle in one run, where lowdiff's threads may run (see Placement): what placing the work in the
cores' idle moments would buy, each placement judged against the same drift.

Usage:
    python experiments/full_cost_threads.py [--steps 320] [--full-every 8] [--full-copy background]
        [--phases] [--policies normal,idle-copy,idle-threads,nice-threads] [--full-only]

Timing tables only; tests never run this. Print progress to stderr.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(REPO_ROOT))
import gpt  # noqa: E402

GROUPS = ("training", "intra-op", "lowdiff", "io_uring")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def thread_times() -> dict[int, tuple[int, int, str]]:
    """(ns on a CPU, ns waiting for one, kernel name) of every thread of this process, by tid."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                run_ns, wait_ns, _ = f.read().split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue   # a thread that ended between the listing and the read
        out[int(tid)] = (int(run_ns), int(wait_ns), comm)
    return out


def machine_busy_s() -> float:
    """Busy CPU time of the whole machine so far (all tasks, /proc/stat), in seconds."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]     # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def group_of(tid: int, comm: str, python_names: dict[int, str]) -> str:
    if tid == os.getpid():
        return "training"
    if comm.startswith("iou-"):
        return "io_uring"
    name = python_names.get(tid)
    if name is not None and (name.startswith("lowdiff") or name.startswith("fastio")):
        return "lowdiff"
    return "intra-op"


class Sampler:
    """CPU and run-queue time per group between two calls of ``sample``."""

    def __init__(self):
        self.prev = thread_times()
        self.prev_busy = machine_busy_s()
        self.prev_process = time.process_time()
        self.prev_wall = time.perf_counter()

    def sample(self) -> dict[str, float]:
        now = thread_times()
        python_names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        cpu = dict.fromkeys(GROUPS, 0.0)
        wait = dict.fromkeys(GROUPS, 0.0)
        by_thread: dict[str, float] = {}
        for tid, (run_ns, wait_ns, comm) in now.items():
            before = self.prev.get(tid, (0, 0, comm))
            g = group_of(tid, comm, python_names)
            cpu[g] += (run_ns - before[0]) / 1e6
            wait[g] += (wait_ns - before[1]) / 1e6
            if g == "lowdiff":   # and each of our threads on its own, by its Python name
                name = python_names[tid]
                by_thread[name] = by_thread.get(name, 0.0) + (run_ns - before[0]) / 1e6
        busy = machine_busy_s()
        process = time.process_time()
        wall = time.perf_counter()
        row = {"wall": (wall - self.prev_wall) * 1e3}
        row.update({f"cpu:{g}": cpu[g] for g in GROUPS})
        row.update({f"wait:{g}": wait[g] for g in GROUPS})
        row["threads"] = by_thread
        # CPU of threads that ended since the last sample (seen by process_time, not by the listing)
        row["cpu:ended"] = max(0.0, (process - self.prev_process) * 1e3 - sum(cpu.values()))
        row["cpu:machine-other"] = max(0.0, (busy - self.prev_busy) - (process - self.prev_process)) * 1e3
        self.prev, self.prev_busy, self.prev_process, self.prev_wall = now, busy, process, wall
        return row


class PhaseClock:
    """CPU (thread_time) and wall time of the full writer's phases, per full checkpoint: wraps the
    methods the persist thread calls (a measurement hook: the library itself is unchanged)."""

    PHASES = (("copy", "lowdiff.format.fullckpt", "Snapshot", "copy"),
              ("write+fsync", "lowdiff.format.fullckpt", "Snapshot", "persist"),
              ("manifest+retention", "lowdiff.store.directory", "CheckpointStore", "commit_full"))

    def __init__(self):
        import importlib
        self.cpu: dict[str, list[float]] = {name: [] for name, *_ in self.PHASES}
        self.wall: dict[str, list[float]] = {name: [] for name, *_ in self.PHASES}
        for name, module, cls, method in self.PHASES:
            owner = getattr(importlib.import_module(module), cls)
            setattr(owner, method, self._timed(name, getattr(owner, method)))

    def _timed(self, name, fn):
        def timed(*a, **kw):
            if threading.current_thread() is threading.main_thread():
                return fn(*a, **kw)      # only the persist thread's share
            c0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.cpu[name].append((time.thread_time() - c0) * 1e3)
                self.wall[name].append((time.perf_counter() - w0) * 1e3)
        return timed

    def report(self) -> None:
        print("\nthe full writer's phases, median per full checkpoint (CPU of the persist thread; wall):")
        for name in self.cpu:
            if self.cpu[name]:
                print(f"  {name:<22} cpu {statistics.median(self.cpu[name]):>7.1f} ms   wall "
                      f"{statistics.median(self.wall[name]):>7.1f} ms   ({len(self.cpu[name])} calls)")


POLICIES = ("normal", "idle-copy", "idle-threads", "nice-threads")


class Placement:
    """Where lowdiff's background work may run, switched per full-checkpoint cycle so that the
    policies compared share one run (drift and neighbours hit them alike):

      normal        every thread at the default policy
      idle-copy     the full writer's copy (a C call without the GIL) at SCHED_IDLE, the rest normal
      idle-threads  every lowdiff/fastio thread at SCHED_IDLE (a thread holding the GIL can then be
                    starved while the training thread waits for the GIL)
      nice-threads  every lowdiff/fastio thread at nice 19 (still some CPU whenever it is runnable,
                    so a thread holding the GIL is not starved; switching back to normal between
                    cycles needs root)
    """

    def __init__(self):
        from lowdiff.format.fullckpt import Snapshot
        self.policy = "normal"
        plain_copy = Snapshot.copy
        placement = self

        def copy(snapshot, on_training_thread: bool) -> None:
            if on_training_thread or placement.policy != "idle-copy":
                return plain_copy(snapshot, on_training_thread)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            try:
                return plain_copy(snapshot, on_training_thread)
            finally:
                os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        Snapshot.copy = copy

    def set(self, policy: str) -> None:
        self.policy = policy
        idle = policy == "idle-threads"
        for t in threading.enumerate():
            if t.native_id is not None and (t.name.startswith("lowdiff") or t.name.startswith("fastio")):
                os.sched_setscheduler(t.native_id, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
                os.setpriority(os.PRIO_PROCESS, t.native_id, 19 if policy == "nice-threads" else 0)


def train(args) -> tuple[list[dict], float, int]:
    import lowdiff

    torch.set_num_threads(args.threads)
    cfg = gpt.PRESETS[args.model]
    model = gpt.build_model(cfg, seed=0)
    raw = torch.optim.AdamW(model.parameters(), lr=3e-4)
    os.makedirs(args.dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="full-cost-", dir=args.dir)
    # --full-only: Dense and no differentials, the full checkpoint alone (bench_overhead's
    # lowdiff-full5-only); otherwise TopK(0.01) with a differential every step.
    compressor = lowdiff.Dense() if args.full_only else lowdiff.TopK(ratio=0.01)
    opt = lowdiff.wrap(raw, model, directory, compressor=compressor,
                       schedule=lowdiff.Fixed(full_every=args.full_every, batch_steps=10,
                                              differentials=not args.full_only),
                       options=lowdiff.Options(full_copy=args.full_copy))
    state = [p.detach() for p in model.parameters()]
    placement = Placement() if args.policies != ["normal"] else None
    rows = []
    sampler = None
    total = args.warmup + args.steps
    for s in range(total):
        if s == args.warmup:
            opt.flush()
            sampler = Sampler()
        # lowdiff counts steps from 1: the step() of loop index s makes step s + 1, and takes a
        # full checkpoint when s + 1 is a multiple of full_every. A cycle starts at that step.
        since_full = (s + 1) % args.full_every
        cycle = (s + 1) // args.full_every
        policy = args.policies[cycle % len(args.policies)]
        if placement is not None and since_full == 0:
            placement.set(policy)
        x, y = gpt.batch(cfg, s)
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sampler is not None:
            # one sample per iteration: everything between two samples (batch, forward, backward,
            # step) is the iteration's
            row = sampler.sample()
            # the training thread neither ran nor waited for a CPU: it slept (on the GIL, on
            # torch's workers at the end of a parallel region, on a lock or on I/O)
            row["sleep:training"] = row["wall"] - row["cpu:training"] - row["wait:training"]
            row["since_full"], row["policy"], row["cycle"] = since_full, policy, cycle
            rows.append(row)
        if s % 50 == 0:
            log(f"  step {s}/{total}")
    opt.close()
    shutil.rmtree(directory, ignore_errors=True)
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    state_bytes += sum(t.numel() * t.element_size() for st in raw.state.values() for t in st.values()
                       if isinstance(t, torch.Tensor))
    return rows, memcpy_ms(state_bytes), state_bytes


def memcpy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)   # touched: not the shared zero page
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def report(rows: list[dict], copy_ms: float, state_bytes: int, args) -> None:
    keys = ["wall"] + [f"cpu:{g}" for g in GROUPS] + ["cpu:ended", "cpu:machine-other"] + \
        ["wait:training", "wait:intra-op", "sleep:training"]
    heads = ["wall", "train cpu", "intra cpu", "lowdiff cpu", "uring cpu", "ended cpu", "others cpu",
             "train wait", "intra wait", "train sleep"]
    far = args.full_every // 2
    what = "lowdiff Dense, no differentials" if args.full_only else "lowdiff TopK(0.01)"
    print(f"\nfull-checkpoint cost by thread group, {args.model} GPT, {what}, full_every="
          f"{args.full_every}, full_copy={args.full_copy}, {args.steps} timed steps, torch threads "
          f"{args.threads}; state {state_bytes / 2**20:.1f} MiB, one memcpy {copy_ms:.1f} ms")
    print(f"median ms per iteration; 'baseline' = the iterations {far}..{args.full_every - 1} after a full "
          f"checkpoint, pooled; 'added' = the excess of iterations 0..{far - 1} over it, summed")
    summary = []
    for policy in args.policies:
        mine = [r for r in rows if r["policy"] == policy]
        classes = sorted({r["since_full"] for r in mine})
        med = {c: {k: statistics.median(r[k] for r in mine if r["since_full"] == c) for k in keys} for c in classes}
        # Baseline: the second half of the cycle, pooled (the persist is long over by then).
        base = {k: statistics.median(r[k] for r in mine if r["since_full"] >= far) for k in keys}
        cycles = sum(r["since_full"] == 0 for r in mine)
        print(f"\n[{policy}] ({cycles} cycles)")
        print(f"{'iteration':<14}" + "".join(f"{h:>12}" for h in heads))
        for c in classes[:far]:
            label = "full step" if c == 0 else f"full + {c}"
            print(f"{label:<14}" + "".join(f"{med[c][k]:>12.1f}" for k in keys))
        print(f"{'baseline':<14}" + "".join(f"{base[k]:>12.1f}" for k in keys))
        extra = {k: sum(med[c][k] - base[k] for c in classes[:far]) for k in keys}
        print(f"{'added (sum)':<14}" + "".join(f"{extra[k]:>+12.1f}" for k in keys))
        names = sorted({n for r in mine for n in r["threads"]})
        print("lowdiff's threads, CPU ms added per full checkpoint (the excess over the baseline, summed):")
        for name in names:
            per_class = {c: statistics.median(r["threads"].get(name, 0.0) for r in mine if r["since_full"] == c)
                         for c in classes}
            baseline = statistics.median(r["threads"].get(name, 0.0) for r in mine if r["since_full"] >= far)
            added = sum(per_class[c] - baseline for c in classes[:far])
            print(f"  {name:<28}{added:>+8.1f}   (baseline {baseline:.1f} per iteration)")
        summary.append((policy, extra))
    print(f"\nwhole cycles (full step and the {args.full_every - 1} after it), median wall per cycle, per "
          f"placement: work put off to later iterations counts here too")
    for policy in args.policies:
        per_cycle: dict[int, float] = {}
        counts: dict[int, int] = {}
        for r in rows:
            if r["policy"] == policy:
                per_cycle[r["cycle"]] = per_cycle.get(r["cycle"], 0.0) + r["wall"]
                counts[r["cycle"]] = counts.get(r["cycle"], 0) + 1
        whole = [w for c, w in per_cycle.items() if counts[c] == args.full_every]
        if whole:
            print(f"  {policy:<14} {statistics.median(whole):8.1f} ms ({len(whole)} cycles)")
    print("\nwhat one full checkpoint adds to the iterations, per placement (same run, cycles alternating):")
    for policy, extra in summary:
        print(f"  {policy:<14} wall {extra['wall']:>+6.1f} ms = {extra['wall'] / copy_ms:>4.1f} copies of the state; "
              f"lowdiff's threads' CPU {extra['cpu:lowdiff']:>+5.1f} ms; training thread waited for a CPU "
              f"{extra['wait:training']:>+5.1f} ms, slept {extra['sleep:training']:>+5.1f} ms")
    print(f"(on {os.cpu_count()} cores with torch using {args.threads} threads every core trains: CPU work "
          f"beside training costs wall time unless it runs in the cores' idle moments)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=sorted(gpt.PRESETS), default="quick")
    p.add_argument("--steps", type=int, default=320)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--full-every", type=int, default=8)
    p.add_argument("--full-copy", choices=("background", "in_step"), default="background")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--full-only", action="store_true", help="Dense, no differentials: the full checkpoint alone")
    p.add_argument("--dir", default=str(REPO_ROOT / "runs" / "full_cost_threads"),
                   help="where the checkpoints go (a fresh directory inside it; default runs/full_cost_threads)")
    p.add_argument("--phases", action="store_true",
                   help="also time the full writer's phases (copy, write, manifest) on its thread")
    p.add_argument("--policies", default="normal",
                   help="placements of lowdiff's threads, one per cycle in turn: " + ", ".join(POLICIES))
    args = p.parse_args(argv)
    args.policies = args.policies.split(",")
    if not set(args.policies) <= set(POLICIES):
        p.error(f"--policies: choose from {', '.join(POLICIES)}")
    log(f"training {args.warmup} + {args.steps} steps ...")
    phases = PhaseClock() if args.phases else None
    rows, copy_ms, state_bytes = train(args)
    report(rows, copy_ms, state_bytes, args)
    if phases is not None:
        phases.report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
