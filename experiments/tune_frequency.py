"""Frequency tuning: does the controller's (full_every, batch_steps) waste less time than fixed
settings and the published full-checkpoint policies?

1. measure: train GPT models (experiments/gpt.py) on this machine three ways in one run — without
   lowdiff, with Dense differentials every step (rare full checkpoints), and with full checkpoints
   only every few steps — and take from outside what each costs per step (the step-time
   differences: recording a differential, and a full checkpoint amortised), the real resume of a
   long chain (load, and replay per differential as recovery.resume reports it) and a process
   restart; next to them, what the controller estimates from inside (its replay estimate).
2. simulate: long runs with exponentially distributed failures for cost profiles built from those
   measurements (small/large model x fast/slow storage x 1/h and 1/12h failures); total wasted time
   of the controller's choice (differentials="auto": it may choose full checkpoints only), of the
   controller keeping differentials, of every point of a grid of fixed (F, B) and (F, no
   differentials), of Young/Daly and of CheckFreq on full checkpoints only. The same failure times
   for every policy of a profile. One device: a full persist shares it with the batch writes.
3. real: train in a child process, SIGKILL it at exponentially distributed times (short MTBF),
   restart with resume; goodput (durable steps per wall-clock second) of "auto" and of fixed
   settings (with and without differentials) under the same failure times. "auto" keeps its
   measurements across restarts (CONTROLLER.json).

Prints fixed-width tables, writes CSVs to --out, and plots when matplotlib is installed.
``--quick`` finishes in under five minutes. Slow storage is the measured fast storage with every
I/O time (persist, batch write, load, read during replay) multiplied by --slow-factor: this machine
has one disk, and tmpfs is no faster than it for these sizes.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import lowdiff  # noqa: E402
import recovery  # noqa: E402
from lowdiff.compress import decompress_into  # noqa: E402
from lowdiff.costmodel import (  # noqa: E402
    Costs,
    Limits,
    checkfreq_full_every,
    evaluate,
    solve,
    young_daly_full_every,  # noqa: E402
)
from lowdiff.inventory import take_inventory  # noqa: E402

LARGE = gpt.GPTConfig(n_layer=8, n_head=8, n_embd=512, vocab_size=16384, block_size=128, seq_len=128,
                      batch_size=4)
MODELS = {"small": gpt.PRESETS["quick"], "large": LARGE}
GRID_B = (1, 2, 4, 8, 16, 32, 64)


# ------------------------------------------------------------------ 1. measure
FULL_ONLY_EVERY = 4      # measure(): the interval of the full-only run (its per-step cost amortises S)


COMPRESSORS = {"dense": lowdiff.Dense(), "topk": lowdiff.TopK(ratio=0.01)}


def _step(cfg, model, opt, step: int, sparsify=None) -> None:
    x, y = gpt.batch(cfg, step)
    model(x, y).backward()
    if sparsify is not None:
        # The plain trainer of a TopK run trains on the same sparsified gradients (the training's
        # math, e.g. for its communication), so only what lowdiff adds is charged to recording.
        for p in model.parameters():
            if p.grad is not None:
                compressed = sparsify.compress(p.grad, 0, {})
                if compressed.kind == "sparse":
                    decompress_into(compressed, p.grad)
    opt.step()
    opt.zero_grad()


def measure(name: str, compressor: str, root: str, rounds: int) -> dict:
    """Costs of model ``name`` checkpointed under ``root``. Three trainers of the same model — plain,
    differentials (``compressor``) every step (one full checkpoint, at the start), full checkpoints only
    every FULL_ONLY_EVERY steps — take turns in blocks of FULL_ONLY_EVERY steps, ``rounds`` times,
    so the machine's changing load falls on all three alike; what a checkpointing trainer's steps
    take longer on average is what its checkpointing costs. Then the differential run is resumed
    (a chain of all its steps) and its load and replay times taken from recovery.resume."""
    cfg = MODELS[name]
    directories = {kind: tempfile.mkdtemp(prefix=f"tune-{name}-{kind}-", dir=root) for kind in ("diffs", "fulls")}
    options = {"plain": None, "diffs": {"full_every": 10**6, "batch_steps": 4},
               "fulls": {"full_every": FULL_ONLY_EVERY, "differentials": False}}
    trainers = {}
    for kind, wrap_options in options.items():
        model = gpt.build_model(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if wrap_options is not None:
            opt = lowdiff.wrap(opt, model, directories[kind], compressor=COMPRESSORS[compressor], **wrap_options)
        trainers[kind] = (model, opt)
    steps, spent = dict.fromkeys(trainers, 0), dict.fromkeys(trainers, 0.0)
    sparse = COMPRESSORS[compressor] if compressor != "dense" else None
    for block in range(rounds + 1):          # the first block warms up (base checkpoint, optimizer state)
        for kind, (model, opt) in trainers.items():
            started = time.perf_counter()
            for _ in range(FULL_ONLY_EVERY):
                _step(cfg, model, opt, steps[kind], sparse if kind == "plain" else None)
                steps[kind] += 1
            if block:
                spent[kind] += time.perf_counter() - started
    per_step = {kind: spent[kind] / (rounds * FULL_ONLY_EVERY) for kind in trainers}
    seen = {}
    for kind in ("diffs", "fulls"):
        opt = trainers[kind][1]
        opt.flush()
        seen[kind] = opt.stats()["controller"]["costs"]
        opt.close()
    model2 = gpt.build_model(cfg)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-4)
    resumed = recovery.resume(directories["diffs"], model2, opt2)
    for directory in directories.values():
        shutil.rmtree(directory)
    return {"model": name, "compressor": compressor, "params": trainers["plain"][0].num_params(),
            "base_step_s": per_step["plain"],
            "diff_step_s": per_step["diffs"], "full_only_step_s": per_step["fulls"], "controller": seen["diffs"],
            "controller_full_only": seen["fulls"], "resume_load_s": resumed.load_s,
            "resume_replay_s_per_step": resumed.replay_s / max(resumed.replayed, 1), "replayed": resumed.replayed}


def measure_restart(name: str) -> float:
    """A restarted trainer's time to its first resume call: interpreter, imports, model build."""
    code = ("import sys; sys.path.insert(0, 'experiments'); import torch, lowdiff, recovery, gpt, "
            f"tune_frequency as t2; gpt.build_model(t2.MODELS[{name!r}])")
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd=_repo())
    return time.perf_counter() - started


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def costs_of(m: dict, restart_s: float, slow: float) -> Costs:
    """Simulation costs, measured from outside where the outside sees more: recording is what steps
    with differentials take longer than plain ones; a full checkpoint is what the full-only run's
    steps take longer, times its interval (stall, copy and the persist's competition for the CPU),
    never less than the controller's own measure of it; the real resume's load and replay. Sizes,
    bandwidth and write costs are the controller's."""
    c = m["controller"]
    read_s = c["diff_bytes_per_step"] / c["write_bytes_per_s"]
    full_s = max(m["controller_full_only"]["stall_s"], (m["full_only_step_s"] - m["base_step_s"]) * FULL_ONLY_EVERY)
    return Costs(step_s=m["base_step_s"], record_s=max(0.0, m["diff_step_s"] - m["base_step_s"]),
                 stall_s=full_s, persist_s=c["persist_s"] * slow, full_bytes=c["full_bytes"],
                 batch_fixed_s=c["batch_fixed_s"] * slow, diff_bytes_per_step=c["diff_bytes_per_step"],
                 write_bytes_per_s=c["write_bytes_per_s"] / slow, load_s=m["resume_load_s"] * slow,
                 replay_s=m["resume_replay_s_per_step"] + read_s * (slow - 1), restart_s=restart_s)


# ------------------------------------------------------------------ 2. simulate
def simulate(c: Costs, full_every: int, batch_steps: int | None, gaps: np.ndarray, total_steps: int) -> float:
    """Wall-clock time to complete ``total_steps`` with failures after the successive ``gaps``
    (seconds of wall time between failures). Model of the pipeline in docs/controller.md: steps of
    step_s (+ record_s), a stall per full checkpoint, one persist in flight, batches durable
    batch_write_s after they close, one device shared by persists and batch writes, resume from the
    newest durable step, restart + load + replay after each failure (failures during it start it
    over)."""
    tau = c.step_s + (c.record_s if batch_steps else 0.0)
    write_s = c.batch_write_s(batch_steps) if batch_steps else 0.0
    if batch_steps:
        tau = max(tau, write_s / batch_steps)       # a writer that cannot keep up paces training
    # One device: the batch writes of an interval and its full persist must all fit in it, and a
    # persist gets the share of the device the batch writes leave (it is durable that much later).
    diff_share = write_s / (batch_steps * tau) if batch_steps else 0.0
    period = max(c.stall_s + full_every * tau, c.persist_s + full_every * diff_share * tau)
    persist_s = min(period, c.persist_s / (1 - diff_share)) if diff_share < 1 else period

    def end_time(e):                                 # session step e (>= 1) ends at
        k = (e - 1) // full_every
        return k * period + c.stall_s + (e - k * full_every) * tau

    def prev_end(n):                                 # the last batch boundary at or before n
        k, j = divmod(n, full_every)
        return n if j == 0 else k * full_every + (j // batch_steps) * batch_steps

    wall, start, chain_full, g = 0.0, 0, 0, 0
    while True:
        needed = total_steps - start
        if gaps[g] >= end_time(needed):
            return wall + end_time(needed)
        t = gaps[g]
        g += 1
        wall += t
        k = int(t // period)
        done = k * full_every + min(full_every, max(0, int((t - k * period - c.stall_s) // tau)))
        kd = math.floor((t - persist_s) / period) if t >= persist_s else -1
        full = start + kd * full_every if kd >= 0 else chain_full
        if batch_steps:
            e = prev_end(done)
            if e > 0 and end_time(e) + write_s > t:
                e = prev_end(e - 1)
            resume_at = max(start + e, full)
        else:
            resume_at = max(full, start)
        recover_s = c.restart_s + c.load_s + c.replay_s * (resume_at - full)
        while gaps[g] < recover_s:                    # failures during recovery start it over
            wall += gaps[g]
            g += 1
        gaps[g] -= recover_s                          # the rest of the gap runs the new session
        wall += recover_s
        start, chain_full = resume_at, full


def profiles(measured: dict, restart: dict, slow_factor: float) -> list[tuple[str, Costs, float]]:
    out = []
    for (model, compressor), m in measured.items():
        for storage, slow in (("fast", 1.0), ("slow", slow_factor)):
            for label, per_hour in (("1/h", 1.0), ("1/12h", 1 / 12)):
                out.append((f"{model}/{compressor}/{storage}/{label}", costs_of(m, restart[model], slow), per_hour))
    return out


def _grid_full_every(c: Costs, optima: list[int]) -> list[int]:
    """Intervals around each policy's optimum, from the persist pipeline's least upward."""
    lo = max(1, math.ceil(c.persist_s / c.step_s))
    ratios = (0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 4, 10)
    return sorted({max(lo, round(f * r)) for f in optima for r in ratios} | {lo})


def run_simulation(profile_list, failures: int, seed: int, out_dir: str) -> list[dict]:
    rows = []
    for index, (name, c, per_hour) in enumerate(profile_list):
        # No memory budget: memory is not a time the simulation can charge, so the grid ignores it,
        # and the controller gets the same freedom (a Dense record of the large model is 135 MB:
        # two pending ones break the default 256 MiB, which would rule out differentials there).
        limits = Limits(failure_rate_per_s=per_hour / 3600, batch_memory_bytes=2**40)
        mtbf_s = 3600 / per_hour
        gaps = np.random.default_rng(seed + index).exponential(mtbf_s, failures * 3 + 100)
        total = int(failures * mtbf_s / c.step_s)
        ideal = total * c.step_s
        chosen = {"controller": solve(c, limits, differentials="auto"),   # may choose full checkpoints only
                  "controller-diffs": solve(c, limits)}                     # differentials kept
        fulls = {"young-daly-full": young_daly_full_every(c, limits), "checkfreq-full": checkfreq_full_every(c)}
        sim = {label: (e.full_every, e.batch_steps) for label, e in chosen.items()}
        sim.update({label: (f, None) for label, f in fulls.items()})
        grid_f = _grid_full_every(c, [e.full_every for e in chosen.values()] +
                                  [solve(c, limits, differentials=False).full_every])
        for f in grid_f:
            for b in (*GRID_B, None):
                sim[f"grid F={f} B={b or '-'}"] = (f, b)
        for label, (f, b) in sim.items():
            wall = simulate(c, f, b, gaps.copy(), total)
            rows.append({"profile": name, "policy": label.split(" ")[0], "full_every": f, "batch_steps": b or "-",
                         "wasted_h": (wall - ideal) / 3600, "waste_pct": 100 * (wall - ideal) / wall,
                         "model_waste_pct": 100 * evaluate(c, limits, f, b).waste})
    _write_csv(os.path.join(out_dir, "tune_simulation.csv"), rows)
    return rows


def print_simulation(rows: list[dict]) -> bool:
    print(f"\n{'profile':<24}{'controller F/B':>15}{'wasted h':>10}{'best grid F/B':>15}{'wasted h':>10}"
          f"{'ctl/best':>9}{'Young-full':>11}{'CheckFreq':>10}{'ctl-diffs':>10}{'F/B':>9}{'model %':>9}"
          f"{'sim %':>8}  target")
    met_all = True
    for profile in dict.fromkeys(r["profile"] for r in rows):
        mine = [r for r in rows if r["profile"] == profile]
        ctl = next(r for r in mine if r["policy"] == "controller")
        kept = next(r for r in mine if r["policy"] == "controller-diffs")
        grid = min((r for r in mine if r["policy"] == "grid"), key=lambda r: r["wasted_h"])
        young = next(r for r in mine if r["policy"] == "young-daly-full")
        cf = next(r for r in mine if r["policy"] == "checkfreq-full")
        near_best = ctl["wasted_h"] <= 1.05 * grid["wasted_h"]
        below = ctl["wasted_h"] < min(young["wasted_h"], cf["wasted_h"])
        # Where full checkpoints alone are best, the controller takes Young's interval too: a tie.
        tie = ctl["batch_steps"] == "-" and ctl["wasted_h"] <= young["wasted_h"] and \
            ctl["wasted_h"] <= cf["wasted_h"]
        met = near_best and below
        met_all &= met
        verdict = "met" if met else ("tie (full-only)" if near_best and tie else "MISSED")
        print(f"{profile:<24}{str(ctl['full_every']) + '/' + str(ctl['batch_steps']):>15}{ctl['wasted_h']:>10.2f}"
              f"{str(grid['full_every']) + '/' + str(grid['batch_steps']):>15}{grid['wasted_h']:>10.2f}"
              f"{ctl['wasted_h'] / grid['wasted_h']:>9.3f}{young['wasted_h']:>11.2f}{cf['wasted_h']:>10.2f}"
              f"{kept['wasted_h']:>10.2f}{str(kept['full_every']) + '/' + str(kept['batch_steps']):>9}"
              f"{ctl['model_waste_pct']:>9.3f}{ctl['waste_pct']:>8.3f}  {verdict}")
    return met_all


# ------------------------------------------------------------------ 3. real run
def child(directory: str, settings: str, rate_per_hour: float, steps: int, model_name: str) -> None:
    """The trainer the driver kills: resume, train to ``steps``, print each step."""
    torch.set_num_threads(1)
    cfg = MODELS[model_name]
    model = gpt.build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt = lowdiff.wrap(opt, model, directory, compressor=lowdiff.Dense(), failure_rate_per_hour=rate_per_hour,
                       **wrap_options(settings))
    start = recovery.resume(directory, model, opt)
    print(f"resumed {start}", flush=True)
    for step in range(start, steps):
        x, y = gpt.batch(cfg, step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step + 1}", flush=True)
    opt.close()


def wrap_options(settings: str) -> dict:
    """"auto": everything auto, differentials included (consent given); "auto-diffs": full_every
    and batch_steps auto, differentials kept; "F/B": fixed; "F/off": full checkpoints only."""
    if settings == "auto":
        return {"full_every": "auto", "batch_steps": "auto", "differentials": "auto"}
    if settings == "auto-diffs":
        return {"full_every": "auto", "batch_steps": "auto"}
    full, batch = settings.split("/")
    if batch == "off":
        return {"full_every": int(full), "differentials": False}
    return {"full_every": int(full), "batch_steps": int(batch)}


def real_runs(settings_list: list[str], gaps: list[float], budget_s: float, mtbf_s: float, model: str,
              root: str) -> list[dict]:
    """Each setting trains for ``budget_s`` of wall time in lives of the same lengths (``gaps``):
    a trainer is started, SIGKILLed when its life ends, restarted with resume. The settings take
    turns life by life (in a rotating order), so a change in the machine's load falls on all of
    them alike. Goodput =
    durable steps at the end / wall time."""
    lives, total = [], 0.0
    for gap in gaps:
        lives.append(min(gap, budget_s - total))
        total += lives[-1]
        if total >= budget_s:
            break
    directories = {s: tempfile.mkdtemp(prefix="tune-real-", dir=root) for s in settings_list}
    for index, life_s in enumerate(lives):
        # The order rotates, so no setting always starts right after the same one was killed.
        turn = index % len(settings_list)
        for settings in settings_list[turn:] + settings_list[:turn]:
            directory = directories[settings]
            command = [sys.executable, os.path.abspath(__file__), "--child", directory, settings,
                       str(3600 / mtbf_s), "100000000", model]
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=_repo())
            try:
                proc.wait(timeout=life_s)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
    rows = []
    for settings, directory in directories.items():
        durable = max(take_inventory(directory, skip_other_versions=True).manifest.durable_step(), 0)
        chosen = ""
        try:
            with open(os.path.join(directory, "CONTROLLER.json")) as f:
                kept = json.load(f)
            s = kept["settings"]
            chosen = f"{s['full_every']}/{s['batch_steps'] if s['differentials'] else 'off'}"
            restarts = kept["samples"].get("restart_s") or [math.nan]
            restart_s = float(np.median(restarts))
        except (OSError, ValueError, KeyError):
            restart_s = math.nan
        shutil.rmtree(directory)
        rows.append({"settings": settings, "last_in_force": chosen or settings, "durable_steps": durable,
                     "wall_s": budget_s, "kills": len(lives) - 1, "restart_s": restart_s,
                     "goodput_steps_per_s": durable / budget_s})
    return rows


def run_real(args, out_dir: str) -> list[dict]:
    gaps = list(np.random.default_rng(args.seed).exponential(args.mtbf_s, 1000))
    rows = real_runs(args.real_settings, gaps, args.real_budget_s, args.mtbf_s, "small", args.root)
    _write_csv(os.path.join(out_dir, "tune_real.csv"), rows)
    best_fixed = max(r["goodput_steps_per_s"] for r in rows if not r["settings"].startswith("auto"))
    print(f"\nreal run: small model, SIGKILL after exponential gaps (MTBF {args.mtbf_s:g} s, the same lives for "
          f"each setting, taking turns), {args.real_budget_s:g} s each; auto told {3600 / args.mtbf_s:g} "
          f"failures/h")
    print(f"{'settings':<12}{'in force':>10}{'durable steps':>14}{'kills':>7}{'restart s':>10}{'goodput/s':>11}"
          f"{'vs best fixed':>15}")
    for r in rows:
        print(f"{r['settings']:<12}{r['last_in_force']:>10}{r['durable_steps']:>14}{r['kills']:>7}"
              f"{r['restart_s']:>10.2f}{r['goodput_steps_per_s']:>11.3f}{r['goodput_steps_per_s'] / best_fixed:>15.3f}")
    return rows


# ------------------------------------------------------------------ main
def _write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def _plot(rows: list[dict], out_dir: str) -> None:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plots)")
        return
    for profile in dict.fromkeys(r["profile"] for r in rows):
        fig, ax = plt.subplots()
        for b in GRID_B:
            pts = sorted((r["full_every"], r["wasted_h"]) for r in rows
                         if r["profile"] == profile and r["policy"] == "grid" and r["batch_steps"] == b)
            ax.plot(*zip(*pts), marker=".", label=f"B={b}")
        ctl = next(r for r in rows if r["profile"] == profile and r["policy"] == "controller")
        ax.plot([ctl["full_every"]], [ctl["wasted_h"]], "k*", markersize=12, label="controller")
        ax.set(xscale="log", xlabel="full_every", ylabel="wasted hours", title=profile)
        ax.legend()
        fig.savefig(os.path.join(out_dir, f"tune_{profile.replace('/', '_')}.png"))
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, failures and a shorter real run (<5 min)")
    parser.add_argument("--root", default=os.getcwd(), help="where checkpoints are written (the storage measured)")
    parser.add_argument("--out", default="results", help="directory for the CSVs and plots")
    parser.add_argument("--slow-factor", type=float, default=10.0, help="slow storage: I/O times multiplied by this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtbf-s", type=float, default=20.0, help="real run: mean time between SIGKILLs")
    parser.add_argument("--real-budget-s", type=float, help="real run: wall time per setting")
    parser.add_argument("--real-settings", nargs="+",
                        default=["auto", "auto-diffs", "10/1", "50/4", "200/16", "10/off", "40/off"],
                        help='"auto", "auto-diffs" (differentials kept), "F/B" or "F/off" (full checkpoints only)')
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--real-only", action="store_true", help="only the real run (no measurement, no simulation)")
    parser.add_argument("--compressors", nargs="+", default=list(COMPRESSORS), choices=list(COMPRESSORS),
                        help="the differentials' compressors measured (the real run uses Dense)")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        directory, settings, rate, steps, model = args.child
        child(directory, settings, float(rate), int(steps), model)
        return 0
    if args.real_budget_s is None:
        args.real_budget_s = 30.0 if args.quick else 150.0
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    # One thread: the machine's cores are shared with the background writers (and, here, with
    # other users); oversubscribed intra-op threads make step times erratic.
    torch.set_num_threads(1)
    if args.real_only:
        return _real_verdict(run_real(args, args.out))
    # --quick: the large model with Dense only (its TopK run alone takes minutes on a loaded machine).
    measured = {(name, compressor): measure(name, compressor, args.root, 3 if args.quick else 8)
                for name in MODELS for compressor in args.compressors
                if not (args.quick and name == "large" and compressor != "dense")}
    restart = {name: measure_restart(name) for name in MODELS}
    print(f"{'model':<13}{'params':>8}{'step s':>9}{'+record s':>10}{'full S s':>9}{'persist s':>10}{'full MB':>9}"
          f"{'batch fix s':>12}{'MB/step':>9}{'write MB/s':>11}{'replay s':>10}{'(ctl est)':>10}{'load s':>8}"
          f"{'restart s':>10}")
    for (name, compressor), m in measured.items():
        c = costs_of(m, restart[name], 1.0)
        print(f"{name + '/' + compressor:<13}{m['params'] / 1e6:>7.1f}M{c.step_s:>9.3f}{c.record_s:>10.4f}"
              f"{c.stall_s:>9.4f}"
              f"{c.persist_s:>10.3f}{c.full_bytes / 1e6:>9.1f}{c.batch_fixed_s:>12.4f}"
              f"{c.diff_bytes_per_step / 1e6:>9.2f}"
              f"{c.write_bytes_per_s / 1e6:>11.0f}{c.replay_s:>10.4f}{m['controller']['replay_s']:>10.4f}"
              f"{c.load_s:>8.3f}{c.restart_s:>10.2f}")
    with open(os.path.join(args.out, "tune_measured.json"), "w") as f:
        json.dump({"measured": {f"{n}/{c}": m for (n, c), m in measured.items()}, "restart_s": restart}, f, indent=1)
    rows = run_simulation(profiles(measured, restart, args.slow_factor), 300 if args.quick else 3000, args.seed,
                          args.out)
    met = print_simulation(rows)
    print(f"simulation target (controller within 5% of the best grid point, below Young/Daly and CheckFreq "
          f"full-only): {'met in every profile' if met else 'MISSED in some profile (see above)'}")
    print("(controller: differentials='auto', may choose full checkpoints only, F/-; ctl-diffs: the controller "
          "keeping differentials; grid: F x B in " + str(GRID_B) + " and F/- without differentials)")
    _plot(rows, args.out)
    if not args.skip_real:
        _real_verdict(run_real(args, args.out))
    return 0


def _real_verdict(real: list[dict]) -> int:
    best = max(r["goodput_steps_per_s"] for r in real if not r["settings"].startswith("auto"))
    auto = next(r["goodput_steps_per_s"] for r in real if r["settings"] == "auto")
    print(f"real-run target (auto within 5% of the best fixed goodput): {'met' if auto >= 0.95 * best else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
