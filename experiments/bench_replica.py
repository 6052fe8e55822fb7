"""What does replica mode (LowDiff+) cost a training step? Against no checkpointing at all and
against Dense differentials, measured in the same run.

Trains the GPT of experiments/gpt.py (default: the "quick" preset, ~5.3M parameters, because this
is a 2-core CPU machine) with AdamW(lr=3e-4) under each configuration, from the same initial
weights on the same synthetic batches. Configurations:

  plain          no checkpoints (the baseline)
  dense-1        lowdiff Dense(): a differential every step, written one step per batch
  dense-10       lowdiff Dense(): a differential every step, written in batches of 10 steps
  replica-1      lowdiff Dense(), replica=True, full_every=1: the replica persisted as often as
                 the disk allows (the next step after the previous write ended)
  replica-10     lowdiff Dense(), replica=True, full_every=10

Scheduling: the machine is shared, so the configurations run in short blocks (``--block-steps``)
round robin, the order rotated every round, each configuration keeping its own model, optimizer
and checkpoint directory alive between its blocks (one checkpointing configuration's background
work may spill into the next block: the rotation spreads that over all of them). Training uses
``--threads`` intra-op threads (default 1, leaving a core to lowdiff's background threads, as
the issue suggests). The step time covers forward, backward, opt.step() and zero_grad(); its
median over all timed steps is reported, with the ratio to plain. Bytes per step are the bytes
of the files the configuration committed (sampled every step, so retention cannot hide one),
divided by its steps. For replica modes: how often training waited for the replica and the
largest lag in steps (from opt.stats()["replica"]).
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
import gpt  # noqa: E402

import lowdiff  # noqa: E402

CONFIGS = {
    "plain": None,
    "dense-1": {"full_every": 10_000, "batch_steps": 1},
    "dense-10": {"full_every": 10_000, "batch_steps": 10},
    "replica-1": {"full_every": 1, "replica": True},
    "replica-10": {"full_every": 10, "replica": True},
}


class Trainer:
    """One configuration's model, optimizer and checkpoint directory, advanced block by block."""

    def __init__(self, name: str, options: dict | None, preset: str, root: Path):
        self.name, self.cfg = name, gpt.PRESETS[preset]
        self.model = gpt.build_model(preset)
        opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.directory = root / name
        self.opt = opt if options is None else lowdiff.wrap(opt, self.model, self.directory,
                                                            compressor=lowdiff.Dense(), keep_full=2, **options)
        self.step_s: list[float] = []
        self.files: dict[str, int] = {}
        self.steps = 0

    def run(self, steps: int, timed: bool) -> None:
        for _ in range(steps):
            x, y = gpt.batch(self.cfg, self.steps)
            started = time.perf_counter()
            self.model(x, y).backward()
            self.opt.step()
            self.opt.zero_grad()
            elapsed = time.perf_counter() - started
            self.steps += 1
            if timed:
                self.step_s.append(elapsed)
            self._sample_files()

    def _sample_files(self) -> None:
        if not self.directory.exists():
            return
        for entry in os.scandir(self.directory):
            if entry.name.endswith((".ldf", ".ldd")):   # full checkpoints, differential batches
                try:
                    self.files[entry.name] = max(self.files.get(entry.name, 0), entry.stat().st_size)
                except FileNotFoundError:
                    pass   # retention deleted it between listing and stat

    def finish(self) -> dict:
        row = {"config": self.name, "steps": len(self.step_s),
               "median_ms": 1e3 * statistics.median(self.step_s),
               "p90_ms": 1e3 * statistics.quantiles(self.step_s, n=10)[-1]}
        if isinstance(self.opt, lowdiff.LowDiffOptimizer):
            self.opt.flush()
            self._sample_files()
            replica = self.opt.stats().get("replica", {})
            row.update(waits=replica.get("training_waits", 0), max_lag=replica.get("max_lag_steps", 0),
                       persists=replica.get("persists", 0))
            self.opt.close()
        row["mb_per_step"] = sum(self.files.values()) / max(self.steps, 1) / 2**20
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
    trainers = [Trainer(name, CONFIGS[name], args.preset, root) for name in names]
    for trainer in trainers:
        trainer.run(args.warmup, timed=False)
    for round_ in range(args.rounds):
        shift = round_ % len(trainers)
        for trainer in trainers[shift:] + trainers[:shift]:
            trainer.run(args.block_steps, timed=True)
    rows = [trainer.finish() for trainer in trainers]
    base = next((r["median_ms"] for r in rows if r["config"] == "plain"), rows[0]["median_ms"])
    dense = next((r["median_ms"] for r in rows if r["config"] == "dense-1"), None)
    params = sum(p.numel() for p in trainers[0].model.parameters())
    print(f"preset={args.preset} ({params / 1e6:.1f}M parameters), {args.threads} training thread(s), "
          f"{args.rounds} rounds x {args.block_steps} steps per config, root={root}")
    header = f"{'config':<12}{'median ms':>10}{'p90 ms':>9}{'vs plain':>9}{'vs dense-1':>11}{'MB/step':>9}" \
             f"{'waits':>7}{'max lag':>8}{'persists':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        r["vs_plain"] = r["median_ms"] / base
        r["vs_dense1"] = r["median_ms"] / dense if dense else float("nan")
        print(f"{r['config']:<12}{r['median_ms']:>10.1f}{r['p90_ms']:>9.1f}{r['vs_plain']:>9.3f}"
              f"{r['vs_dense1']:>11.3f}{r['mb_per_step']:>9.2f}{r.get('waits', '-'):>7}"
              f"{r.get('max_lag', '-'):>8}{r.get('persists', '-'):>9}")
    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
