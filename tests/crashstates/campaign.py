"""The fault campaign of issue #33, in full: ``python tests/crashstates/campaign.py [--help]``.

Runs what the tests under tests/crashstates run a bounded sample of, and prints one table of
totals (kills, resumes checked, exact, below the durable step, damage cases, detected, wrong
states) plus every failure found:

* power loss: every crash state the explorer builds for the full-checkpoint, batch-commit,
  retention, tier-drain and partitioned-set workloads (fsmodel.py; ``--samples`` random states per
  crash point besides the directory-operation prefixes), each resumed and checked, with later
  sessions (for the partitioned workload on ``--partitioned-later`` of them); then sampled states
  of the multi-directory workloads in the weaker per-directory model;
* SIGKILL: ``--auto-kills`` runs with "auto" settings killed at random crash points,
  ``--torchrun-kills`` torchrun restarts each of DDP with tiers and DDP in replica mode;
* damage: ``--damage`` swap/flip/truncate cases each on a TopK directory and on partitioned shares;
* a full disk on ext4 on a loop device, local and shared tier, at ``--full-disk`` free sizes each.
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

COLUMNS = ("crash states", "kills", "resumes checked", "exact", "below durable", "damage cases", "detected",
           "wrong states", "other failures")


def power_loss(args, rows, failures, base) -> None:
    import checker
    import explore
    import partitioned
    import workload
    from lowdiff_helpers import reference_digests

    runs = [(name, "journal") for name in args.workloads] + \
        [(name, "per-directory") for name in args.per_directory if args.per_directory_samples]
    for name, model in runs:
        work_dir = tempfile.mkdtemp(dir=base)
        if name == "partitioned":
            reference: dict = {}
            later = [args.partitioned_later]

            def check(root, required, state, work_dir=work_dir, reference=reference, later=later):
                if not reference:
                    reference.update(partitioned.reference_of(os.path.join(work_dir, "run")))
                later[0] -= 1
                return partitioned.check(root, required, reference, work_dir, later=later[0] >= 0)
        else:
            work = workload.WORKLOADS[name]
            ref = reference_digests(work.steps + work.extra)

            def check(root, required, state, work=work, ref=ref):
                return checker.check(work, root, required, ref)
        samples = args.samples if model == "journal" else args.per_directory_samples
        report = explore.explore(name, work_dir, samples=samples, limit=None, seed=args.seed, check=check,
                                 model=model)
        print(f"[{model}] {report.line()}", flush=True)
        o = report.outcomes
        label = f"power loss: {name}" + ("" if model == "journal" else " (per-dir)")
        rows[label] = {"crash states": report.checked, "resumes checked": report.checked, "exact": o["exact"],
                       "below durable": o["below"], "wrong states": o["wrong"],
                       "other failures": o["error"] + o["later"]}
        failures += report.failures
        shutil.rmtree(work_dir, ignore_errors=True)


def sigkills(args, rows, failures, base, rng) -> None:
    import kills
    from lowdiff_helpers import reference_digests

    steps = 30
    reference = reference_digests(steps)
    found = []
    for n in range(args.auto_kills):
        work = tempfile.mkdtemp(dir=base)
        settings = ("auto", "keywords")[n % 2]
        phase = str(rng.choice(kills.AUTO_PHASES))
        found.append(kills.auto_kill(work, settings, phase, int(rng.integers(1, 4)), steps, reference))
        shutil.rmtree(work, ignore_errors=True)
    _kill_row(rows, failures, "SIGKILL: auto settings", found)
    for mode in ("tiers", "replica"):
        ref_dir = tempfile.mkdtemp(dir=base)
        reference_ddp = kills.ddp_reference(ref_dir, "dense" if mode == "replica" else "topk")
        phases = kills.TIER_PHASES if mode == "tiers" else kills.faults.PHASES
        found = []
        for _ in range(args.torchrun_kills):
            work = tempfile.mkdtemp(dir=base)
            found.append(kills.torchrun_kill(work, mode, str(rng.choice(phases)), int(rng.integers(1, 4)),
                                             int(rng.integers(0, 2)), reference_ddp))
            shutil.rmtree(work, ignore_errors=True)
        _kill_row(rows, failures, f"SIGKILL: torchrun DDP + {mode}", found)


def _kill_row(rows, failures, label, found) -> None:
    rows[label] = {"kills": sum(k.killed for k in found), "resumes checked": sum(k.resumes for k in found),
                   "exact": sum(k.exact for k in found), "below durable": sum(k.below for k in found),
                   "wrong states": sum(k.wrong for k in found),
                   "other failures": sum(bool(k.problems) and not (k.below or k.wrong) for k in found)}
    failures += [p for k in found for p in k.problems]
    print(f"{label}: {len(found)} runs, {rows[label]}", flush=True)


def damage_cases(args, rows, failures, base, rng) -> None:
    import damage
    import partitioned
    from lowdiff_helpers import reference_digests, resumed_digest, train_directory

    steps = 20
    reference = reference_digests(steps)
    clean = train_directory(os.path.join(base, "damage-clean"), steps)

    def resume_topk(directory):
        step, digest = resumed_digest(directory)
        return int(step), digest == reference[int(step)]
    partitioned.launch(os.path.join(base, "damage-part"), os.path.join(base, "damage-run"), traced=False)
    ref_part = partitioned.reference_of(os.path.join(base, "damage-run"))

    def resume_part(directory):
        step, digest = partitioned.resumed_shared_at(directory)
        return step, digest == ref_part[step]
    for label, source, resume, clean_step in (
            ("damage: TopK directory", clean, resume_topk, steps),
            ("damage: partitioned shares", os.path.join(base, "damage-part", "ckpt"), resume_part, partitioned.STEPS)):
        cases = [damage.run_case(source, os.path.join(base, "damage-work"), damage.MODES[n % 3], rng, resume,
                                 clean_step) for n in range(args.damage)]
        harmless = sum(c.harmless for c in cases)
        rows[label] = {"damage cases": len(cases) - harmless, "resumes checked": len(cases),
                       "detected": sum(c.detected for c in cases),
                       "exact": sum(c.outcome == "exact" for c in cases),
                       "wrong states": sum(c.outcome == "wrong" for c in cases),
                       "other failures": sum(not c.detected and not c.harmless for c in cases)}
        failures += [f"{label}: {c}" for c in cases if c.outcome == "wrong" or not (c.detected or c.harmless)]
        print(f"{label}: {rows[label]} ({harmless} flips changed only padding: not counted as damage)", flush=True)


def full_disks(args, rows, failures, base, rng) -> None:
    import fulldisk
    from lowdiff_helpers import reference_digests

    reference = reference_digests(fulldisk.MAX_STEPS)
    for tier in ("local", "shared"):
        found, ran = [], 0
        for _ in range(args.full_disk):
            work = tempfile.mkdtemp(dir=base)
            try:
                found += fulldisk.run_full_disk(work, tier, int(rng.integers(100, 250)), reference)
                ran += 1
            except OSError as exc:
                print(f"full disk ({tier}): skipped: {exc}")
                break
            shutil.rmtree(work, ignore_errors=True)
        rows[f"full disk (ext4 loop): {tier}"] = {"resumes checked": ran, "exact": ran - len(found),
                                                  "other failures": len(found)}
        failures += found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="*", default=["full", "batch", "retention", "tier", "partitioned"])
    p.add_argument("--samples", type=int, default=6, help="random crash states per crash point")
    p.add_argument("--per-directory", nargs="*", default=["tier", "partitioned"],
                   help="workloads also explored in fsmodel's per-directory persistence model")
    p.add_argument("--per-directory-samples", type=int, default=4)
    p.add_argument("--partitioned-later", type=int, default=4, help="partitioned states given a 2-rank later session")
    p.add_argument("--auto-kills", type=int, default=10)
    p.add_argument("--torchrun-kills", type=int, default=3)
    p.add_argument("--damage", type=int, default=30)
    p.add_argument("--full-disk", type=int, default=3)
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--skip", nargs="*", default=[], choices=["power", "kills", "damage", "disk"])
    args = p.parse_args()
    torch.set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    rows: dict = {}
    failures: list = []
    started = time.monotonic()
    base = tempfile.mkdtemp(prefix="lowdiff-campaign-")
    try:
        for part, run in (("power", power_loss), ("kills", sigkills), ("damage", damage_cases), ("disk", full_disks)):
            if part not in args.skip:
                run(args, rows, failures, base) if part == "power" else run(args, rows, failures, base, rng)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    total = collections.Counter()
    print(f"\n{'campaign':34}" + "".join(f"{c:>16}" for c in COLUMNS))
    for label, row in rows.items():
        total.update(row)
        print(f"{label:34}" + "".join(f"{row[c] if c in row else '-':>16}" for c in COLUMNS))
    print(f"{'TOTAL':34}" + "".join(f"{total[c]:>16}" for c in COLUMNS))
    print(f"\n{len(failures)} failures ({time.monotonic() - started:.0f} s, seed {args.seed})")
    for line in failures:
        print(f"- {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
