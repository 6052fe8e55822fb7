"""Question: with differential batches placed round robin over N separately throttled drives
(``lowdiff.Options(stripe_dirs=...)``), how fast are they written while training, and how fast does a
resume read the chain back, against all batches in one directory on one drive (N = 1)?

Set-up: bench_stripe.py's drives (4 loop devices, ext4, each throttled by the block-layer throttle to
--mbps MB/s each way, in a cgroup the measuring process joins; root needed, else plain directories and
the numbers say nothing about drives).

Measured in one process, all in the same run (median of --repeat rounds, every N in each round): a
real training loop (``lowdiff.wrap`` over AdamW, two Linear(--width, --width) layers, ``lowdiff.Dense()``
so every step records the whole gradient: about 8 MiB a step at --width 1024), --steps steps, one full
checkpoint (step 0) and batches of --batch-steps steps, N = 1 in one directory, N > 1 with the other
N - 1 drives as ``stripe_dirs``:

  train    wall time of the steps and ``close()`` (every batch durable); batch MB/s = the batch
           files' bytes / that time
  resume   ``recovery.resume`` into fresh objects (full checkpoint + the whole chain replayed), after
           every checkpoint file was dropped from the page cache (posix_fadvise DONTNEED, per file)
  spread   how many batch bytes each drive holds

Usage: sudo python experiments/bench_stripe_batches.py --mbps 100 --repeat 3
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_stripe import DEVICES, Drives  # noqa: E402  (experiments/bench_stripe.py)
from blockthrottle import default_image_dir  # noqa: E402  (experiments/blockthrottle.py)


def _drop_cache(directories) -> None:
    for directory in directories:
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _model(width: int):
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def measure(roots: list[str], args) -> dict:
    import torch

    import lowdiff
    import recovery

    torch.set_num_threads(1)
    out: dict = {"train": {}, "resume": {}, "batch_bytes": {}, "spread": {}}
    for round_ in range(args.repeat):
        for n in (1, 2, 4):
            if n > len(roots):
                continue
            home = os.path.join(roots[0], f"n{n}-r{round_}")
            others = tuple(os.path.join(r, f"n{n}-r{round_}") for r in roots[1:n])
            model, opt = _model(args.width)
            opt = lowdiff.wrap(opt, model, home, compressor=lowdiff.Dense(), full_every=100_000,
                               batch_steps=args.batch_steps, options=lowdiff.Options(stripe_dirs=others))
            inputs = torch.randn(64, args.width)
            started = time.perf_counter()
            for _ in range(args.steps):
                model(inputs).square().mean().backward()
                opt.step()
                opt.zero_grad()
            opt.close()
            out["train"].setdefault(n, []).append(time.perf_counter() - started)
            with open(os.path.join(home, "MANIFEST.json")) as f:
                batches = json.load(f)["manifest"]["batches"]
            out["batch_bytes"][n] = sum(b["nbytes"] for b in batches)
            spread: dict = {}
            for b in batches:
                spread[b.get("dir") or home] = spread.get(b.get("dir") or home, 0) + b["nbytes"]
            out["spread"][n] = [spread.get(d, 0) for d in (home, *others)]
            _drop_cache((home, *others))
            model, opt = _model(args.width)
            started = time.perf_counter()
            assert recovery.resume(home, model, opt) == args.steps
            out["resume"].setdefault(n, []).append(time.perf_counter() - started)
            for d in (home, *others):
                shutil.rmtree(d)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbps", type=float, default=100.0, help="throttle of each drive, MB/s each way")
    parser.add_argument("--width", type=int, default=1024, help="the two Linear layers' width")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batch-steps", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(REPO_ROOT, "experiments", "results", "bench_stripe_batches.csv"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(json.loads(args.child), args)))
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="lowdiff-bench-stripe-batches-"))
    drives = Drives(DEVICES, args.mbps, 1024, workdir, default_image_dir())
    try:
        print(f"drives:   {drives.kind}")
        print(f"throttle: {drives.throttle}")
        for note in drives.notes:
            print(f"note:     {note}")
        env = {**os.environ, "PYTHONPATH": REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        child = [sys.executable, os.path.abspath(__file__), "--width", str(args.width), "--steps", str(args.steps),
                 "--batch-steps", str(args.batch_steps), "--repeat", str(args.repeat),
                 "--child", json.dumps([str(r) for r in drives.roots])]
        proc = subprocess.run(child, capture_output=True, text=True, env=env, preexec_fn=drives.preexec())
        if proc.returncode:
            print(proc.stderr, file=sys.stderr)
            return proc.returncode
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        drives.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return report(result, args)


def report(result: dict, args) -> int:
    train = {int(k): statistics.median(v) for k, v in result["train"].items()}
    resume = {int(k): statistics.median(v) for k, v in result["resume"].items()}
    print(f"{args.steps} steps, batches of {args.batch_steps}, width {args.width}, median of {args.repeat} rounds; "
          f"MB/s = 1e6 B/s; each drive limited to {args.mbps:.0f} MB/s")
    print(f"{'N':>2} {'batch MiB':>10} {'train s':>8} {'batch MB/s':>11} {'x N=1':>6} {'resume s':>9} "
          f"{'x N=1':>6}  batch MiB per drive")
    rows = []
    for n in sorted(train):
        nbytes = result["batch_bytes"][str(n)]
        row = {"n_devices": n, "batch_bytes": nbytes, "train_s": train[n], "batch_bytes_per_s": nbytes / train[n],
               "train_x_one": train[1] / train[n], "resume_s": resume[n], "resume_x_one": resume[1] / resume[n],
               "mbps_limit": args.mbps}
        spread = " ".join(f"{b / 2**20:.0f}" for b in result["spread"][str(n)])
        print(f"{n:>2} {nbytes / 2**20:>10.0f} {train[n]:>8.2f} {row['batch_bytes_per_s'] / 1e6:>11.0f} "
              f"{row['train_x_one']:>6.2f} {resume[n]:>9.2f} {row['resume_x_one']:>6.2f}  {spread}")
        rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"csv: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
