"""``python -m lowdiff``: demo, inspect, verify, export."""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile

from .batchfile import BatchReader
from .errors import CheckpointError, CorruptCheckpointError
from .fullckpt import load_full, read_full_index
from .manifest import MANIFEST_NAME, load_manifest, plan_chain, read_manifest


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes} B"
        nbytes /= 1024
    return str(nbytes)


def cmd_inspect(args) -> int:
    manifest = load_manifest(args.directory, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    print(f"directory      {os.path.abspath(args.directory)}")
    print(f"durable step   {max(manifest.durable_step(), 0)}")
    print(f"full checkpoints ({len(manifest.fulls)}):")
    for full in sorted(manifest.fulls, key=lambda f: f.step):
        chain = plan_chain(manifest, full.step)
        end = chain[-1].last if chain else full.step
        try:
            index = read_full_index(os.path.join(args.directory, full.file))
            tensors = len(index["tensors"])
        except (CorruptCheckpointError, OSError) as exc:
            tensors = f"unreadable: {exc}"
        print(f"  step {full.step:>8}  {_human(full.nbytes):>10}  tensors {tensors}  {full.file}  "
              f"chain -> step {end} ({len(chain)} batches)")
    total = sum(b.nbytes for b in manifest.batches)
    steps = sum(b.last - b.first + 1 for b in manifest.batches)
    print(f"differential batches ({len(manifest.batches)}, {steps} steps, {_human(total)}"
          f"{f', {_human(total // steps)}/step' if steps else ''}):")
    for batch in manifest.batches:
        print(f"  steps {batch.first:>8}-{batch.last:<8} {_human(batch.nbytes):>10}  {batch.file}")
    return 0


def cmd_verify(args) -> int:
    """Read every listed file completely and check every checksum."""
    try:  # resume can rebuild a damaged manifest from the files, but verify must still report it
        read_manifest(args.directory)
        manifest_problem = 0
    except CorruptCheckpointError as exc:
        manifest_problem = 1
        print(f"CORRUPT  {exc}")
    manifest = load_manifest(args.directory, warn=lambda m: print(f"warning: {m}", file=sys.stderr))
    problems = 0
    for full in manifest.fulls:
        path = os.path.join(args.directory, full.file)
        try:
            load_full(path)
            print(f"ok       {full.file}")
        except (CorruptCheckpointError, OSError, EOFError) as exc:
            problems += 1
            print(f"CORRUPT  {exc}")
    for batch in manifest.batches:
        path = os.path.join(args.directory, batch.file)
        try:
            with BatchReader(path) as reader:
                if reader.index_error:
                    raise reader.index_error
                for position in range(len(reader.entries)):
                    reader.read_record(position)
                if reader.steps != list(range(batch.first, batch.last + 1)):
                    raise CorruptCheckpointError(path, f"holds steps {reader.steps[:1]}..{reader.steps[-1:]}, "
                                                       f"the manifest says {batch.first}..{batch.last}")
            print(f"ok       {batch.file}")
        except (CorruptCheckpointError, OSError, EOFError) as exc:
            problems += 1
            print(f"CORRUPT  {exc}")
    print(f"{len(manifest.fulls) + len(manifest.batches) - problems} files verify, {problems} do not"
          + (f"; {MANIFEST_NAME} does not verify" if manifest_problem else ""))
    return 1 if problems or manifest_problem else 0


def cmd_export(args) -> int:
    from recovery import export

    step = export(args.directory, args.output, step=args.step)
    print(f"exported step {step} to {args.output}")
    return 0


def cmd_demo(args) -> int:
    """Reference run; checkpointed run SIGKILLed at a random step; resume; compare digests."""
    work = args.dir or tempfile.mkdtemp(prefix="lowdiff-demo-", dir=os.getcwd())
    os.makedirs(work, exist_ok=True)
    ckpt = os.path.join(work, "ckpt")
    kill_at = args.kill_at or random.Random().randint(args.steps // 4, 3 * args.steps // 4)
    common = ["--steps", str(args.steps), "--compressor", args.compressor]
    demo = [sys.executable, "-m", "lowdiff.demo"]
    print(f"lowdiff demo in {work}: {args.steps} steps, {args.compressor} differentials every step, "
          f"SIGKILL at step {kill_at}")
    ref_path = os.path.join(work, "reference.txt")
    print("1) uninterrupted reference run (no checkpointing) ...", flush=True)
    subprocess.run(demo + ["reference", *common, "--digests", ref_path], check=True, stdout=subprocess.DEVNULL)
    reference = dict(line.split() for line in open(ref_path))
    print(f"2) checkpointed run, killed with SIGKILL after step {kill_at} ...", flush=True)
    run_path = os.path.join(work, "run.txt")
    proc = subprocess.Popen(demo + ["train", ckpt, *common, "--digests", run_path], stdout=subprocess.PIPE, text=True)
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


def main(argv=None) -> int:
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
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="read every file and check every checksum")
    p.add_argument("directory")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("export", help="write the state of a step as a plain torch.save file")
    p.add_argument("directory")
    p.add_argument("--step", type=int)
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(func=cmd_export)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
