"""``python -m lowdiff``: demo, inspect, verify, export."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from lowdiff.cli import shareinspect, tierinspect
from lowdiff.distributed.partition import is_partitioned
from lowdiff.errors import CheckpointError
from lowdiff.format.fullckpt import read_full_index
from lowdiff.store.directory import lock_holder
from lowdiff.store.inventory import take_inventory
from lowdiff.store.manifest import plan_chain
from lowdiff.store.rankdirs import rank_directory
from lowdiff.tiers.objectstore import is_object_url


def _human(nbytes: int) -> str:
    value: float = nbytes
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.1f} {unit}" if unit != "B" else f"{value} B"
        value /= 1024
    return str(value)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _checkpoint_directory(directory: str) -> str:
    if not os.path.exists(directory):
        raise FileNotFoundError(f"{directory} does not exist")
    if not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory} is a file, not a checkpoint directory")
    return directory


def _note_live_trainer(directory: str) -> None:
    holder = lock_holder(directory)
    if holder is not None:
        print(f"note: a trainer (pid {holder}) is writing {directory}; what it commits or retires while "
              f"this runs may differ from the listing")


# (temporary directory, s3:// URL) of each bucket commit fetched by this command: what it prints
# and logs names the URL (_UrlsNamed), not the directory, which is gone when the command ends.
_FETCHED: list = []


def _named(text: str) -> str:
    for staging, url in _FETCHED:
        text = text.replace(os.path.join(staging, ""), f"{url}/").replace(staging, url)
    return text


class _UrlsNamed(logging.Filter):
    """While a command runs: its standard output and lowdiff's log records with the fetched
    commits' temporary directories replaced by their s3:// URLs."""

    def __init__(self):
        super().__init__()
        self._stdout = sys.stdout

    def write(self, text: str) -> int:
        return self._stdout.write(_named(text))

    def __getattr__(self, name):
        return getattr(self._stdout, name)

    def filter(self, record: logging.LogRecord) -> bool:
        if _FETCHED:
            record.msg, record.args = _named(record.getMessage()), ()
        return True

    def __enter__(self):
        sys.stdout = self
        logging.getLogger("lowdiff").addFilter(self)
        return self

    def __exit__(self, *exc):
        sys.stdout = self._stdout
        logging.getLogger("lowdiff").removeFilter(self)
        return False


@contextlib.contextmanager
def _fetched(path: str):
    """(directory, problems): an ``s3://`` URL's newest commit fetched into a temporary directory,
    every object checked against its size and CRC-32C ([(object, why)] of those that are not
    right); a path as it is."""
    if not is_object_url(path):
        yield path, []
        return
    from lowdiff.tiers.bucket import stage
    from lowdiff.tiers.bucketranks import bucket_layout, stage_partitioned

    with tempfile.TemporaryDirectory(prefix="lowdiff-s3-") as staging:
        _FETCHED.append((staging, path.rstrip("/")))
        if bucket_layout(path) == "partitioned":   # rank-NNNNN/ prefixes: a partitioned directory
            committed, problems = True, stage_partitioned(path, staging)
        else:
            manifest, problems = stage(path, staging)
            committed = manifest is not None
        if not committed:
            raise CheckpointError(f"{path} holds no committed lowdiff checkpoint (no MANIFEST-N.json object)")
        print(f"note: the objects the newest commit of {path} names were fetched into {staging}", file=sys.stderr)
        yield staging, problems


def cmd_inspect(args: argparse.Namespace) -> int:
    with _fetched(args.directory) as (directory, _):
        return _inspect(args, directory)


def _inspect(args: argparse.Namespace, directory: str) -> int:
    directory = _checkpoint_directory(directory)
    _inspect_any_layout(directory)
    shared = args.shared or tierinspect.shared_dir_of(directory, _warn)
    if shared is not None:   # storage tiers: the shared tier too, then which one resume would take
        print(f"\nshared tier ({tierinspect.describe_policies(directory)})")
        if is_object_url(shared):
            print(f"directory      {shared} (object store: python -m lowdiff inspect {shared})")
            return 0
        elif os.path.isdir(shared):
            _inspect_any_layout(shared)
        else:
            print(f"directory      {shared} (missing)")
        print(tierinspect.resume_choice(directory, shared))
    return 0


def _inspect_any_layout(directory: str) -> None:
    if is_partitioned(directory):
        print("\n".join(shareinspect.describe(directory, _warn)))
    else:
        _inspect_directory(directory)


def _inspect_directory(directory: str) -> None:
    inventory = take_inventory(directory, skip_other_versions=True)
    for note in inventory.notes:
        _warn(note)
    manifest = inventory.manifest
    print(f"directory      {os.path.abspath(directory)}")
    _note_live_trainer(directory)
    print(f"run            {manifest.run or 'unknown'}")
    print(f"durable step   {max(manifest.durable_step(), 0)}")
    print(f"full checkpoints ({len(manifest.fulls)}):")
    for full in sorted(manifest.fulls, key=lambda f: f.step):
        chain = plan_chain(manifest, full.step)
        end = chain[-1].last if chain else full.step
        tensors: int | str
        try:
            index = read_full_index(os.path.join(directory, full.file))
            tensors = len(index.tensors)
        except (CheckpointError, OSError, EOFError) as exc:
            tensors = f"unreadable: {exc}"
        striped = f"  striped over {len(full.stripes)} drives" if full.stripes else ""
        print(f"  step {full.step:>8}  {_human(full.nbytes + sum(s.nbytes for s in full.stripes)):>10}  "
              f"tensors {tensors}  {full.file}  chain -> step {end} ({len(chain)} batches){striped}")
    total = sum(b.nbytes for b in manifest.batches)
    steps = sum(b.last - b.first + 1 for b in manifest.batches)
    print(f"differential batches ({len(manifest.batches)}, {steps} steps, {_human(total)}"
          f"{f', {_human(total // steps)}/step' if steps else ''}):")
    for batch in manifest.batches:
        where = f"  on {batch.dir}" if batch.dir is not None else ""
        print(f"  steps {batch.first:>8}-{batch.last:<8} {_human(batch.nbytes):>10}  {batch.file}{where}")
    for name, why, _ in inventory.ignored:
        print(f"  not used: {name}: {why}")


def cmd_verify(args: argparse.Namespace) -> int:
    """Read every listed file completely (in parallel), check every checksum and that each file is
    what the manifest says it is, and say which steps are recoverable. Exit 1 if anything does not
    verify, the newest listed step cannot be reached, or there is nothing to verify."""
    from recovery import verify
    from recovery.partitioned.verify import verify_partitioned

    with _fetched(args.directory) as (directory, fetch_problems):
        directory = _checkpoint_directory(directory)
        _note_live_trainer(directory)
        report = verify_partitioned(directory) if is_partitioned(directory) else verify(directory)
    for name, why in fetch_problems:
        print(f"{'corrupt':<8} {name}: {why}")
    for name in report.ok_files:
        print(f"ok       {name}" + ("  (adopted: not listed in the manifest)" if name in report.adopted else ""))
    for name in report.gone:
        print(f"gone     {name} (retired by the trainer writing this directory)")
    for problem in report.problems:
        print(f"{problem.label:<8} {problem.file}: {problem.why}")
    if not report.ok_files and not report.problems:
        print(f"error: {directory} holds no lowdiff checkpoint")
        return 1
    for full_step, full_file, last in report.recoverable:
        print(f"recoverable steps {full_step}..{last} from {full_file}")
    if report.newest_recoverable < report.newest_listed:
        print(f"NEWEST   step {report.newest_listed} is listed but only step {report.newest_recoverable} "
              f"can be recovered")
    print(f"{len(report.ok_files)} files verify, {len(report.problems) + len(fetch_problems)} do not"
          + (" (see above)" if report.problems or fetch_problems else ""))
    return 0 if report.ok and not fetch_problems else 1


def cmd_export(args: argparse.Namespace) -> int:
    from recovery import export

    with _fetched(args.directory) as (directory, _):
        step = export(directory, args.output, step=args.step, format=args.format)
    print(f"exported step {step} to {args.output}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """Reference run; checkpointed run SIGKILLed at a random step; resume; compare digests."""
    work = args.dir or tempfile.mkdtemp(prefix="lowdiff-demo-", dir=os.getcwd())
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt")
    kill_at = args.kill_at or random.Random().randint(args.steps // 4, 3 * args.steps // 4)
    common = ["--steps", str(args.steps), "--compressor", args.compressor]
    demo = [sys.executable, "-m", "lowdiff.cli.demo"]
    print(f"lowdiff demo in {work}: {args.steps} steps, {args.compressor} differentials every step, "
          f"SIGKILL at step {kill_at}")
    ref_path = os.path.join(work, "reference.txt")
    print("1) uninterrupted reference run (no checkpointing) ...", flush=True)
    subprocess.run(demo + ["reference", *common, "--digests", ref_path], check=True, stdout=subprocess.DEVNULL)
    reference = dict(line.split() for line in open(ref_path))
    print(f"2) checkpointed run, killed with SIGKILL after step {kill_at} ...", flush=True)
    run_path = os.path.join(work, "run.txt")
    proc = subprocess.Popen(demo + ["train", ckpt, *common, "--digests", run_path], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None  # stdout=PIPE
    for line in proc.stdout:
        if line.startswith(f"step {kill_at} "):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    print(f"   killed (exit status {proc.returncode})")
    print("3) resume in a new process and train to the end ...", flush=True)
    resume_path = os.path.join(work, "resumed.txt")
    out = subprocess.run(demo + ["train", ckpt, *common, "--digests", resume_path],
                         check=True, stdout=subprocess.PIPE, text=True).stdout
    first = next(line for line in out.splitlines() if line.startswith("resumed at step") or line.startswith("step "))
    start = int(first.split()[3]) if first.startswith("resumed") else 0
    resumed = dict(line.split() for line in open(resume_path))
    if first.startswith("resumed"):
        resumed[str(start)] = first.split()[4]
    print(f"   resumed at step {start}: lost {kill_at - start} steps that were not yet durable")
    ok_start = start == 0 or resumed[str(start)] == reference[str(start)]
    ok_end = resumed[str(args.steps)] == reference[str(args.steps)]
    print(f"   state at step {start:>4}: resumed {resumed.get(str(start), '-')[:16]}  reference "
          f"{reference.get(str(start), '-')[:16]}  {'EQUAL' if ok_start else 'DIFFERENT'}")
    print(f"   state at step {args.steps:>4}: resumed {resumed[str(args.steps)][:16]}  reference "
          f"{reference[str(args.steps)][:16]}  {'EQUAL' if ok_end else 'DIFFERENT'}")
    print("bit-for-bit exact resume: " + ("YES" if ok_start and ok_end else "NO"))
    print(f"(inspect the checkpoint: python -m lowdiff inspect {ckpt})")
    return 0 if ok_start and ok_end else 1


def cmd_tune(args: argparse.Namespace) -> int:
    """Recommended full_every/batch_steps for measured costs (docs/controller.md), next to baselines."""
    import dataclasses
    import json

    from lowdiff.control.costmodel import FIXED_CHOICES, Limits, costs_from_stats, tune_table
    from lowdiff.control.meter import measured_costs

    stats: dict = {}
    fixed: tuple[tuple[int, int], ...] = FIXED_CHOICES
    if args.stats and args.directory:
        raise ValueError("give a checkpoint directory or --stats, not both")
    if args.stats:
        with open(args.stats) as f:
            stats = json.load(f)
        if "samples" in stats and "version" in stats:
            raise ValueError(f"{args.stats} is a CONTROLLER.json, not opt.stats(): give its directory "
                             f"(python -m lowdiff tune {os.path.dirname(args.stats) or '.'} ...)")
    if args.directory:
        measured_in = args.directory
        if is_partitioned(args.directory):   # every rank keeps its own measurements; ranks step alike
            measured_in = rank_directory(args.directory, 0)
            print(f"{args.directory} is partitioned: the costs rank 0 measured")
        measured, settings = measured_costs(measured_in)
        stats = {"controller": {"costs": dataclasses.asdict(measured)}}
        run: tuple = (settings.get("full_every"), settings.get("batch_steps"))
        print(f"{args.directory}: costs its runs measured (CONTROLLER.json); they ran with full_every {run[0]}, "
              f"batch_steps {run[1]}")
        if all(isinstance(v, int) for v in run):
            fixed = ((int(run[0]), int(run[1])),) + tuple(f for f in FIXED_CHOICES if f != run)
    flags = {name: getattr(args, name) for name in ("step_s", "stall_s", "persist_s", "replay_s", "load_s",
                                                    "record_s", "batch_fixed_s", "diff_bytes_per_step",
                                                    "write_bytes_per_s", "restart_s")}
    costs = costs_from_stats(stats, **flags)
    limits = Limits(failure_rate_per_s=args.failure_rate_per_hour / 3600.0, max_recovery_s=args.max_recovery_s)
    print(f"failure rate {args.failure_rate_per_hour:g}/h; step {costs.step_s * 1e3:.1f} ms, full stall "
          f"{costs.stall_s * 1e3:.1f} ms, persist {costs.persist_s:.2f} s, replay {costs.replay_s * 1e3:.2f} ms/step")
    print(f"{'setting':<24}{'full_every':>11}{'batch':>7}{'waste %':>10}{'lost h/1000h':>13}"
          f"{'recovery s':>11}  constraints broken")
    for label, e in tune_table(costs, limits, fixed):
        if fixed is not FIXED_CHOICES and label == "fixed" and (e.full_every, e.batch_steps) == fixed[0]:
            label = "this run's settings"
        print(f"{label:<24}{e.full_every:>11}{e.batch_steps if e.batch_steps is not None else '-':>7}"
              f"{100 * e.waste:>10.3f}{1000 * e.waste:>13.1f}{e.worst_recovery_s:>11.2f}  "
              f"{', '.join(e.violated) or '-'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowdiff", description="lowdiff checkpoint tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="train, SIGKILL, resume, and show the resumed state is exact")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--compressor", default="topk", choices=["topk", "dense"])
    p.add_argument("--dir", help="work directory (default: a new one under the current directory)")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("inspect", help="list steps, full checkpoints, chains and sizes")
    p.add_argument("directory")
    p.add_argument("--shared", help="the shared tier (default: the one the directory's TIERS.json names)")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="read every file and check every checksum")
    p.add_argument("directory")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("export", help="write the state of a step as a plain torch.save file or a DCP directory")
    p.add_argument("directory")
    p.add_argument("--step", type=int)
    p.add_argument("-o", "--output", required=True)
    p.add_argument("--format", choices=["torch", "dcp"], default="torch",
                   help="torch: one torch.save file (default); dcp: a torch.distributed.checkpoint directory")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("tune", help="recommend full_every/batch_steps from measured costs and a failure rate")
    p.add_argument("directory", nargs="?", help="a checkpoint directory: the costs its runs measured (CONTROLLER.json)")
    p.add_argument("--stats", help="a run's opt.stats() saved as JSON (its measured costs)")
    p.add_argument("--failure-rate-per-hour", type=float, required=True)
    p.add_argument("--max-recovery-s", type=float)
    for name in ("step-s", "stall-s", "persist-s", "replay-s", "load-s", "record-s", "batch-fixed-s",
                 "diff-bytes-per-step", "write-bytes-per-s", "restart-s"):
        p.add_argument(f"--{name}", type=float, help="overrides the value in --stats")
    p.set_defaults(func=cmd_tune)
    args = parser.parse_args(argv)
    try:
        with _UrlsNamed():
            return args.func(args)
    except (CheckpointError, OSError, ValueError, ImportError) as exc:   # ImportError: an extra not installed
        print(f"error: {_named(str(exc))}", file=sys.stderr)
        return 2
    finally:
        _FETCHED.clear()
