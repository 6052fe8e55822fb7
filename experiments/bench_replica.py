"""What does replica mode (LowDiff+) cost a training step? Against no checkpointing at all, against
lowdiff's differential modes and against torch.save / DCP async_save every step, measured in the
same run.

Trains the GPT of experiments/gpt.py (default: the "quick" preset, ~5.3M parameters, because this
is a 2-core CPU machine) with AdamW(lr=3e-4) under each configuration, from the same initial
weights on the same synthetic batches. Configurations:

  plain          no checkpoints (the baseline)
  dense-1        lowdiff Dense(): a differential every step, written one step per batch
  dense-10       lowdiff Dense(): a differential every step, written in batches of 10 steps
  topk-10        lowdiff TopK(0.01): a differential every step, batches of 10 steps (compressing
                 changes the training: its overhead against plain includes the compression)
  replica-1      lowdiff Dense(), schedule=lowdiff.Replica(full_every=1): the replica persisted as often as
                 the disk allows (the next step after the previous write ended), batch_steps=10
  replica-10     lowdiff Dense(), schedule=lowdiff.Replica(full_every=10, batch_steps=10)
  save-1         torch.save(model + optimizer state_dict) to a temp file + fsync + rename every step
  dcp-async      torch.distributed.checkpoint.async_save every step (single-process gloo group),
                 each save waiting for the previous one, as a training loop must

Scheduling: the machine is shared, so the configurations run in short blocks (``--block-steps``)
round robin, the order rotated every round, each configuration keeping its own model, optimizer
and checkpoint directory alive between its blocks (one configuration's background work may spill
into the next block: the rotation spreads that over all of them). Training uses ``--threads``
intra-op threads (default 1, leaving a core to background threads, as the issue suggests).

Columns: "step ms" covers forward, backward, opt.step(), the checkpoint call and zero_grad()
(median over all timed steps, p90, ratio to plain); "stall ms" is the median time of opt.step()
plus the checkpoint call minus plain's median opt.step(): what checkpointing blocks the training
thread for; "train cpu" the training thread's own CPU time per step (what checkpointing adds to
it directly: copies, Python), "cpu ms" the process CPU time (all threads: what the background
work needs from the other core) per step; "MB/step" the bytes of the
files the configuration committed (sampled every step, so retention cannot hide one) divided by
its steps; "lag" the median number of steps the newest durable state was behind the step just
taken (lowdiff: ``opt.durable_step``; save-1: 0; DCP: the save in flight); for replica modes how
often training waited for the replica and its largest lag in steps (``opt.stats()["replica"]``).
The last lines compare overheads over plain: replica-1's against save-1's and dcp-async's.
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_overhead  # noqa: E402  (torch.save + fsync and DCP helpers of the overhead benchmark)
import gpt  # noqa: E402

import lowdiff  # noqa: E402

CONFIGS = {
    "plain": None,
    "dense-1": {"full_every": 10_000, "batch_steps": 1},
    "dense-10": {"full_every": 10_000, "batch_steps": 10},
    "topk-10": {"full_every": 10_000, "batch_steps": 10, "compressor": "topk"},
    "replica-1": {"schedule": lowdiff.Replica(full_every=1, batch_steps=10)},
    "replica-10": {"schedule": lowdiff.Replica(full_every=10, batch_steps=10)},
    "save-1": "save",
    "dcp-async": "dcp",
}


class Trainer:
    """One configuration's model, optimizer and checkpoint directory, advanced block by block."""

    def __init__(self, name: str, options, preset: str, root: Path):
        self.name, self.cfg = name, gpt.PRESETS[preset]
        self.model = gpt.build_model(preset)
        self.raw_opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.directory = root / name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.kind = options if isinstance(options, str) else "lowdiff" if options else "plain"
        self.opt = self.raw_opt
        if self.kind == "lowdiff":
            options = dict(options)
            compressor = lowdiff.TopK(0.01) if options.pop("compressor", "dense") == "topk" else lowdiff.Dense()
            self.opt = lowdiff.wrap(self.raw_opt, self.model, self.directory, compressor=compressor,
                                    retention=lowdiff.KeepLast(2), **options)
        self.dcp_handle = None
        self.dcp_dirs: list[Path] = []
        self.step_s: list[float] = []
        self.stall_s: list[float] = []
        self.lag_steps: list[int] = []
        self.files: dict[str, int] = {}
        self.steps = 0
        self.timed_steps = 0
        self.cpu_s = 0.0
        self.thread_cpu_s = 0.0
        self.saved_bytes = 0          # save-1: one file rewritten every step, counted every time

    def run(self, steps: int, timed: bool) -> None:
        for _ in range(steps):
            x, y = gpt.batch(self.cfg, self.steps)
            cpu, thread_cpu = time.process_time(), time.thread_time()
            started = time.perf_counter()
            self.model(x, y).backward()
            stepping = time.perf_counter()
            self.opt.step()
            self._checkpoint()
            stepped = time.perf_counter()
            self.opt.zero_grad()
            elapsed = time.perf_counter() - started
            self.steps += 1
            if timed:
                self.step_s.append(elapsed)
                self.stall_s.append(stepped - stepping)
                self.lag_steps.append(self._lag())
                self.cpu_s += time.process_time() - cpu
                self.thread_cpu_s += time.thread_time() - thread_cpu
                self.timed_steps += 1
            self._sample_files()

    def _checkpoint(self) -> None:
        if self.kind == "save":
            self.saved_bytes += bench_overhead.torch_save_fsync(self.model, self.raw_opt, self.directory / "ckpt.pt")
        elif self.kind == "dcp":
            import torch.distributed.checkpoint as dcp
            bench_overhead.wait_dcp(self.dcp_handle)   # one save in flight at a time
            while len(self.dcp_dirs) > 2:              # keep the disk bounded: the older saves are done
                shutil.rmtree(self.dcp_dirs.pop(0), ignore_errors=True)
            path = self.directory / f"step-{self.steps + 1:06d}"
            self.dcp_dirs.append(path)
            self.dcp_handle = dcp.async_save({"app": bench_overhead.DCPApp(self.model, self.raw_opt)},
                                             checkpoint_id=str(path))

    def _lag(self) -> int:
        if self.kind == "lowdiff":
            return self.steps - max(self.opt.durable_step, 0)
        if self.kind == "dcp":
            return 0 if self.dcp_handle is None or getattr(self.dcp_handle, "done", lambda: False)() else 1
        return 0

    def _sample_files(self) -> None:
        for root, _, names in os.walk(self.directory):
            for name in names:
                if name.endswith((".ldf", ".ldd", ".distcp")):
                    path = os.path.join(root, name)
                    try:
                        self.files[path] = max(self.files.get(path, 0), os.stat(path).st_size)
                    except FileNotFoundError:
                        pass   # retention deleted it between listing and stat

    def finish(self) -> dict:
        row = {"config": self.name, "steps": len(self.step_s),
               "median_ms": 1e3 * statistics.median(self.step_s),
               "p90_ms": 1e3 * statistics.quantiles(self.step_s, n=10)[-1],
               "step_call_ms": 1e3 * statistics.median(self.stall_s),
               "cpu_ms": 1e3 * self.cpu_s / max(self.timed_steps, 1),
               "train_cpu_ms": 1e3 * self.thread_cpu_s / max(self.timed_steps, 1),
               "lag_steps": statistics.median(self.lag_steps)}
        if isinstance(self.opt, lowdiff.LowDiffOptimizer):
            self.opt.flush()
            self._sample_files()
            replica = self.opt.stats().get("replica", {})
            row.update(waits=replica.get("training_waits", "-"), max_lag=replica.get("max_lag_steps", "-"),
                       persists=replica.get("persists", "-"))
            self.opt.close()
        bench_overhead.wait_dcp(self.dcp_handle)
        row["mb_per_step"] = (sum(self.files.values()) + self.saved_bytes) / max(self.steps, 1) / 2**20
        return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench_replica.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="quick", choices=sorted(gpt.PRESETS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--block-steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--dir", default=None, help="checkpoint root (default: a temporary directory)")
    parser.add_argument("--csv", default="bench_replica.csv")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-replica-"))
    names = args.configs.split(",")
    if "dcp-async" in names:
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=0, world_size=1,
                                init_method=f"tcp://127.0.0.1:{bench_overhead.free_port()}")
    load_before = os.getloadavg()
    trainers = [Trainer(name, CONFIGS[name], args.preset, root) for name in names]
    for trainer in trainers:
        trainer.run(args.warmup, timed=False)
    for round_ in range(args.rounds):
        shift = round_ % len(trainers)
        for trainer in trainers[shift:] + trainers[:shift]:
            trainer.run(args.block_steps, timed=True)
    load_after = os.getloadavg()
    rows = [trainer.finish() for trainer in trainers]
    by = {r["config"]: r for r in rows}
    base = by.get("plain", rows[0])
    params = sum(p.numel() for p in trainers[0].model.parameters())
    print(f"preset={args.preset} ({params / 1e6:.1f}M parameters), {args.threads} training thread(s), "
          f"{args.rounds} rounds x {args.block_steps} steps per config, code {bench_overhead.source_version()}")
    print(f"load average (1 min) {load_before[0]:.2f} at start, {load_after[0]:.2f} at end, on "
          f"{os.cpu_count()} cores")
    header = f"{'config':<11}{'step ms':>9}{'p90 ms':>8}{'vs plain':>9}{'stall ms':>9}{'train cpu':>10}{'cpu ms':>8}" \
             f"{'MB/step':>9}{'lag':>5}{'waits':>6}{'max lag':>8}{'persists':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        r["vs_plain"] = r["median_ms"] / base["median_ms"]
        r["stall_ms"] = r["step_call_ms"] - base["step_call_ms"]
        print(f"{r['config']:<11}{r['median_ms']:>9.1f}{r['p90_ms']:>8.1f}{r['vs_plain']:>9.3f}{r['stall_ms']:>9.1f}"
              f"{r['train_cpu_ms']:>10.1f}{r['cpu_ms']:>8.1f}{r['mb_per_step']:>9.2f}{r['lag_steps']:>5.0f}"
              f"{r.get('waits', '-'):>6}{r.get('max_lag', '-'):>8}{r.get('persists', '-'):>9}")
    replica = by.get("replica-1")
    for other in ("save-1", "dcp-async"):
        if replica is None or other not in by:
            continue
        for what, key in (("step time", "median_ms"), ("stall", "step_call_ms")):
            ours, theirs = replica[key] - base[key], by[other][key] - base[key]
            ratio = f"{theirs / ours:.1f}x" if ours > 0 else "inf (replica-1 not above plain)"
            print(f"{what} over plain: replica-1 {ours:+.1f} ms ({100 * ours / base['median_ms']:+.1f}% of a step), "
                  f"{other} {theirs:+.1f} ms ({100 * theirs / base['median_ms']:+.1f}%): {other}/replica-1 = {ratio}")
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    import plotting  # experiments/plotting.py: the figure, drawn from the CSV alone
    print(plotting.try_draw(args.csv))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
