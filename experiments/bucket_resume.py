"""Resume from an object-store shared tier alone (a new node): streamed (the replay starts while
the chain's batch files are still being fetched) against fetching every object first, in one run.

A model trained for --steps steps with lowdiff (AdamW, TopK differentials, one full checkpoint at
step 0, --batch-steps steps per batch file) drains into a bucket of a moto server on 127.0.0.1,
behind the tests' proxy (tests/integration/s3_helpers) whose responses share one link throttled to
--mbps MB/s. Then, --repeats times in alternating order, into fresh objects:

  fetch-first   what resume did before: every object of the newest commit fetched and checked
                (lowdiff.tiers.bucket.stage), then recovery.resume of that directory
                (fetch s and restore s are its two parts)
  streamed      recovery.resume(empty_dir, ..., shared_dir="s3://..."): the full checkpoint is
                fetched and loaded while the first batch files arrive; the replay starts with the
                first, the later ones are fetched at most two ahead
  bound         max(fetch s, restore s) of the same trial: what perfect overlap of fetching with
                loading and replaying would take (neither can be faster than its own part)

Printed: seconds per configuration (median and min over the repeats), streamed / fetch-first and
streamed / bound of the medians, and whether both resumes gave the same bytes (they must). The
CSV (one row per trial) is written next to --out. Times are this machine's and this run's only.

    python experiments/bucket_resume.py [--width 1024] [--steps 60] [--mbps 40] [--repeats 3]
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

REPO_ROOT = Path(__file__).resolve().parent.parent
BUCKET = "lowdiff-bucket-resume"


def build(width: int, layers: int):
    import torch

    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train(args, directory: str, url: str) -> None:
    import torch

    import lowdiff

    model, opt = build(args.width, args.layers)
    opt = lowdiff.wrap(opt, model, directory, compressor=lowdiff.TopK(ratio=args.ratio), full_every=10 ** 6,
                       batch_steps=args.batch_steps, tiers=lowdiff.Tiers(url, shared=lowdiff.KeepAll()))
    data = torch.randn(8, args.width, generator=torch.Generator().manual_seed(1))
    for _ in range(args.steps):
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()
    opt.close()


def fetch_first(args, url: str, scratch: str) -> tuple[dict, float, float]:
    import recovery
    from lowdiff.tiers.bucket import stage

    model, opt = build(args.width, args.layers)
    staging = tempfile.mkdtemp(dir=scratch)
    started = time.perf_counter()
    stage(url, staging)
    fetched = time.perf_counter()
    step = recovery.resume(staging, model, opt)
    done = time.perf_counter()
    assert step == args.steps, step
    shutil.rmtree(staging)
    return model.state_dict(), fetched - started, done - fetched


def streamed(args, url: str, scratch: str) -> tuple[dict, float]:
    import recovery

    model, opt = build(args.width, args.layers)
    started = time.perf_counter()
    step = recovery.resume(os.path.join(scratch, "new-node"), model, opt, shared_dir=url)
    done = time.perf_counter()
    assert step == args.steps, step
    return model.state_dict(), done - started


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="steps trained (the chain resume replays)")
    p.add_argument("--batch-steps", type=int, default=4)
    p.add_argument("--ratio", type=float, default=0.05, help="TopK ratio")
    p.add_argument("--mbps", type=float, default=40.0, help="download bandwidth of the bucket, MB/s")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(REPO_ROOT / "experiments" / "results" / "bucket_resume.csv"))
    args = p.parse_args(argv)
    if shutil.which("moto_server") is None:
        print("moto_server is not installed (pip install 'moto[server]'): nothing to measure")
        return 1
    import torch

    sys.path.insert(0, str(REPO_ROOT / "tests" / "integration"))
    import s3_helpers

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    rows = []
    with tempfile.TemporaryDirectory(prefix="lowdiff-bucket-resume-") as scratch, \
            s3_helpers.moto_server() as server:
        proxy = s3_helpers.FaultProxy(server)
        os.environ.update(s3_helpers.CREDENTIALS, AWS_ENDPOINT_URL=proxy.url)
        client = s3_helpers.s3_client(server)
        client.create_bucket(Bucket=BUCKET)
        url = f"s3://{BUCKET}/run"
        try:
            train(args, os.path.join(scratch, "node1"), url)
            objects = s3_helpers.listing(client, BUCKET, "run/")
            nbytes = sum(size for key, size in objects.items() if not key.split("/")[-1].startswith("MANIFEST"))
            full_bytes = sum(size for key, size in objects.items() if key.split("/")[-1].startswith("full-"))
            proxy.download_bytes_per_s = args.mbps * 1e6
            for repeat in range(args.repeats):
                order = ("fetch-first", "streamed") if repeat % 2 == 0 else ("streamed", "fetch-first")
                row: dict = {"repeat": repeat}
                for name in order:
                    if name == "fetch-first":
                        first, row["fetch_s"], row["restore_s"] = fetch_first(args, url, scratch)
                    else:
                        second, row["streamed_s"] = streamed(args, url, scratch)
                row["fetch_first_s"] = row["fetch_s"] + row["restore_s"]
                row["bound_s"] = max(row["fetch_s"], row["restore_s"])
                row["same_state"] = all(torch.equal(v, second[k]) for k, v in first.items())
                rows.append(row)
                print(f"repeat {repeat}: fetch-first {row['fetch_first_s']:.2f} s (fetch {row['fetch_s']:.2f} + "
                      f"restore {row['restore_s']:.2f}), streamed {row['streamed_s']:.2f} s", flush=True)
        finally:
            proxy.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    params = sum(p.numel() for p in build(args.width, args.layers)[0].parameters())
    print(f"\nmodel {params / 1e6:.1f} M parameters, AdamW, TopK({args.ratio}), {args.steps} steps in batches of "
          f"{args.batch_steps}; bucket: {nbytes / 1e6:.1f} MB ({full_bytes / 1e6:.1f} MB full checkpoint), "
          f"downloads at {args.mbps:g} MB/s on one shared link")
    print(f"{'configuration':<14} {'median s':>9} {'min s':>7} {'x fetch-first':>14} {'x bound':>8}")
    medians = {key: statistics.median(r[key] for r in rows) for key in ("fetch_first_s", "streamed_s", "bound_s",
                                                                        "fetch_s", "restore_s")}
    for name, key in (("fetch-first", "fetch_first_s"), ("  fetch", "fetch_s"), ("  restore", "restore_s"),
                      ("streamed", "streamed_s"), ("bound", "bound_s")):
        print(f"{name:<14} {medians[key]:>9.2f} {min(r[key] for r in rows):>7.2f} "
              f"{medians[key] / medians['fetch_first_s']:>14.2f} {medians[key] / medians['bound_s']:>8.2f}")
    print(f"same state from both: {'yes' if all(r['same_state'] for r in rows) else 'NO'}")
    print(f"csv: {out}")
    return 0 if all(r["same_state"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
