"""Frequency tuning: does the controller's (full_every, batch_steps) waste less time than fixed
settings and the published full-checkpoint policies?

1. measure: train GPT models (experiments/gpt.py) with lowdiff on this machine and take the costs
   the controller measures (opt.stats()), plus what it cannot see from inside: the step time without
   lowdiff, the real resume (load and replay per differential) and a process restart.
2. simulate: long runs with exponentially distributed failures for cost profiles built from those
   measurements (small/large model x fast/slow storage x 1/h and 1/12h failures); total wasted time
   of the controller's choice, of every point of a grid of fixed (F, B), of Young/Daly and of
   CheckFreq on full checkpoints only. The same failure times for every policy of a profile.
3. real: train in a child process, SIGKILL it at exponentially distributed times (short MTBF),
   restart with resume; goodput (durable steps per wall-clock second) of "auto" and of fixed
   settings under the same failure times.

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
def _train(opt, model, cfg, first, last) -> float:
    """Steps first+1..last; the median step time."""
    times = []
    for step in range(first, last):
        started = time.perf_counter()
        x, y = gpt.batch(cfg, step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def measure(name: str, root: str, steps: int) -> dict:
    """Costs of model ``name`` checkpointed under ``root``, as the controller sees them and as
    measured from outside (baseline step, real resume)."""
    cfg = MODELS[name]
    model = gpt.build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    _train(opt, model, cfg, 0, 2)                       # warm-up: allocations, optimizer state
    base_step_s = _train(opt, model, cfg, 2, 2 + steps // 2)
    directory = tempfile.mkdtemp(prefix=f"tune-{name}-", dir=root)
    # Fulls at 0 and steps-6: the resume below replays 6 differentials.
    wrapped = lowdiff.wrap(opt, model, directory, compressor=lowdiff.Dense(), full_every=steps - 6,
                           batch_steps=3)
    _train(wrapped, model, cfg, 0, steps)
    wrapped.flush()
    seen = wrapped.stats()["controller"]["costs"]
    wrapped.close()
    model2 = gpt.build_model(cfg)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-4)
    started = time.perf_counter()
    resumed = recovery.resume(directory, model2, opt2)
    resume_s = time.perf_counter() - started
    shutil.rmtree(directory)
    replay_s = (resume_s - resumed.load_s) / max(resumed.replayed, 1)
    return {"model": name, "params": model.num_params(), "base_step_s": base_step_s, "controller": seen,
            "resume_load_s": resumed.load_s, "resume_replay_s_per_step": replay_s, "replayed": resumed.replayed}


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
    """Simulation costs: the controller's measurements, with what only the outside sees (step time
    without lowdiff, so record_s holds all that recording costs; the real resume's load and replay)."""
    c = m["controller"]
    loaded_step_s = c["step_s"] + c["record_s"]
    read_s = c["diff_bytes_per_step"] / c["write_bytes_per_s"]
    return Costs(step_s=m["base_step_s"], record_s=max(0.0, loaded_step_s - m["base_step_s"]),
                 stall_s=c["stall_s"], persist_s=c["persist_s"] * slow, full_bytes=c["full_bytes"],
                 batch_fixed_s=c["batch_fixed_s"] * slow, diff_bytes_per_step=c["diff_bytes_per_step"],
                 write_bytes_per_s=c["write_bytes_per_s"] / slow, load_s=m["resume_load_s"] * slow,
                 replay_s=m["resume_replay_s_per_step"] + read_s * (slow - 1), restart_s=restart_s)


# ------------------------------------------------------------------ 2. simulate
def simulate(c: Costs, full_every: int, batch_steps: int | None, gaps: np.ndarray, total_steps: int) -> float:
    """Wall-clock time to complete ``total_steps`` with failures after the successive ``gaps``
    (seconds of wall time between failures). Model of the pipeline in docs/controller.md: steps of
    step_s (+ record_s), a stall per full checkpoint, one persist in flight, batches durable
    batch_write_s after they close, resume from the newest durable step."""
    tau = c.step_s + (c.record_s if batch_steps else 0.0)
    write_s = c.batch_write_s(batch_steps) if batch_steps else 0.0
    if batch_steps:
        tau = max(tau, write_s / batch_steps)       # a writer that cannot keep up paces training
    period = max(c.stall_s + full_every * tau, c.persist_s)

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
        kd = math.floor((t - c.persist_s) / period) if t >= c.persist_s else -1
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
    for model in ("small", "large"):
        for storage, slow in (("fast", 1.0), ("slow", slow_factor)):
            for label, per_hour in (("1/h", 1.0), ("1/12h", 1 / 12)):
                out.append((f"{model}/{storage}/{label}", costs_of(measured[model], restart[model], slow), per_hour))
    return out


def run_simulation(profile_list, failures: int, seed: int, out_dir: str) -> list[dict]:
    rows = []
    for index, (name, c, per_hour) in enumerate(profile_list):
        limits = Limits(failure_rate_per_s=per_hour / 3600)
        mtbf_s = 3600 / per_hour
        gaps = np.random.default_rng(seed + index).exponential(mtbf_s, failures * 3 + 100)
        total = int(failures * mtbf_s / c.step_s)
        ideal = total * c.step_s
        policies = {"controller": solve(c, limits), "young-daly-full": None, "checkfreq-full": None}
        fulls = {"young-daly-full": young_daly_full_every(c, limits), "checkfreq-full": checkfreq_full_every(c)}
        best = policies["controller"]
        lo = max(1, math.ceil(c.persist_s / c.step_s))
        grid_f = sorted({max(lo, round(best.full_every * r)) for r in (0.1, 0.25, 0.5, 0.75, 1.5, 2, 4, 10)} | {lo})
        sim = {}
        for label, e in policies.items():
            f, b = (e.full_every, e.batch_steps) if e is not None else (fulls[label], None)
            sim[label] = (f, b, simulate(c, f, b, gaps.copy(), total))
        for f in grid_f:
            for b in GRID_B:
                sim[f"grid F={f} B={b}"] = (f, b, simulate(c, f, b, gaps.copy(), total))
        for label, (f, b, wall) in sim.items():
            predicted = evaluate(c, limits, f, b).waste
            rows.append({"profile": name, "policy": label.split(" ")[0], "full_every": f, "batch_steps": b or "-",
                         "wasted_h": (wall - ideal) / 3600, "waste_pct": 100 * (wall - ideal) / wall,
                         "model_waste_pct": 100 * predicted})
    _write_csv(os.path.join(out_dir, "tune_simulation.csv"), rows)
    return rows


def print_simulation(rows: list[dict]) -> bool:
    print(f"\n{'profile':<18}{'controller F/B':>15}{'wasted h':>10}{'best grid F/B':>15}{'wasted h':>10}"
          f"{'ctl/best':>9}{'Young-full':>11}{'CheckFreq':>10}{'model %':>9}{'sim %':>8}  target")
    met_all = True
    for profile in dict.fromkeys(r["profile"] for r in rows):
        mine = [r for r in rows if r["profile"] == profile]
        ctl = next(r for r in mine if r["policy"] == "controller")
        grid = min((r for r in mine if r["policy"] == "grid"), key=lambda r: r["wasted_h"])
        young = next(r for r in mine if r["policy"] == "young-daly-full")
        cf = next(r for r in mine if r["policy"] == "checkfreq-full")
        met = ctl["wasted_h"] <= 1.05 * grid["wasted_h"] and ctl["wasted_h"] < min(young["wasted_h"], cf["wasted_h"])
        met_all &= met
        print(f"{profile:<18}{str(ctl['full_every']) + '/' + str(ctl['batch_steps']):>15}{ctl['wasted_h']:>10.2f}"
              f"{str(grid['full_every']) + '/' + str(grid['batch_steps']):>15}{grid['wasted_h']:>10.2f}"
              f"{ctl['wasted_h'] / grid['wasted_h']:>9.3f}{young['wasted_h']:>11.2f}{cf['wasted_h']:>10.2f}"
              f"{ctl['model_waste_pct']:>9.3f}{ctl['waste_pct']:>8.3f}  {'met' if met else 'MISSED'}")
    return met_all


# ------------------------------------------------------------------ 3. real run
def child(directory: str, settings: str, rate_per_hour: float, steps: int, model_name: str) -> None:
    """The trainer the driver kills: resume, train to ``steps``, print each step."""
    torch.set_num_threads(1)
    cfg = MODELS[model_name]
    model = gpt.build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    full, batch = settings.split("/")
    opt = lowdiff.wrap(opt, model, directory, compressor=lowdiff.Dense(),
                       full_every=full if full == "auto" else int(full),
                       batch_steps=batch if batch == "auto" else int(batch), failure_rate_per_hour=rate_per_hour)
    start = recovery.resume(directory, model, opt)
    print(f"resumed {start}", flush=True)
    for step in range(start, steps):
        x, y = gpt.batch(cfg, step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step + 1}", flush=True)
    opt.close()


def real_run(settings: str, gaps: list[float], budget_s: float, mtbf_s: float, model: str, root: str) -> dict:
    """Train under ``settings`` for ``budget_s`` of wall time, SIGKILLing the trainer after each
    gap of ``gaps`` (measured from its start); goodput = durable steps at the end / budget."""
    directory = tempfile.mkdtemp(prefix="tune-real-", dir=root)
    command = [sys.executable, os.path.abspath(__file__), "--child", directory, settings, str(3600 / mtbf_s),
               "100000000", model]
    started, kills, index = time.monotonic(), 0, 0
    while time.monotonic() - started < budget_s:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=_repo())
        deadline = min(time.monotonic() + gaps[index % len(gaps)], started + budget_s)
        index += 1
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            kills += 1
        proc.wait()
    durable = max(take_inventory(directory, skip_other_versions=True).manifest.durable_step(), 0)
    shutil.rmtree(directory)
    return {"settings": settings, "durable_steps": durable, "wall_s": budget_s, "kills": kills - 1,
            "goodput_steps_per_s": durable / budget_s}


def run_real(args, out_dir: str) -> list[dict]:
    gaps = list(np.random.default_rng(args.seed).exponential(args.mtbf_s, 1000))
    rows = [real_run(s, gaps, args.real_budget_s, args.mtbf_s, "small", args.root) for s in args.real_settings]
    _write_csv(os.path.join(out_dir, "tune_real.csv"), rows)
    best_fixed = max(r["goodput_steps_per_s"] for r in rows if r["settings"] != "auto/auto")
    print(f"\nreal run: small model, SIGKILL after exponential gaps (MTBF {args.mtbf_s:g} s, the same gaps for "
          f"each setting), {args.real_budget_s:g} s each; auto told {3600 / args.mtbf_s:g} failures/h")
    print(f"{'settings':<12}{'durable steps':>14}{'kills':>7}{'goodput/s':>11}{'vs best fixed':>15}")
    for r in rows:
        print(f"{r['settings']:<12}{r['durable_steps']:>14}{r['kills']:>7}{r['goodput_steps_per_s']:>11.3f}"
              f"{r['goodput_steps_per_s'] / best_fixed:>15.3f}")
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
    parser.add_argument("--real-settings", nargs="+", default=["auto/auto", "10/1", "50/4", "200/16", "1000/64"])
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        directory, settings, rate, steps, model = args.child
        child(directory, settings, float(rate), int(steps), model)
        return 0
    if args.real_budget_s is None:
        args.real_budget_s = 40.0 if args.quick else 150.0
    if args.quick:
        args.real_settings = args.real_settings[:4]
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(args.seed)
    # One thread: the machine's cores are shared with the background writers (and, here, with
    # other users); oversubscribed intra-op threads make step times erratic.
    torch.set_num_threads(1)
    measured = {name: measure(name, args.root, 12 if args.quick else 40) for name in MODELS}
    restart = {name: measure_restart(name) for name in MODELS}
    print(f"{'model':<7}{'params':>8}{'step s':>9}{'+record s':>10}{'stall s':>9}{'persist s':>10}{'full MB':>9}"
          f"{'batch fix s':>12}{'MB/step':>9}{'write MB/s':>11}{'replay s':>10}{'(ctl est)':>10}{'load s':>8}"
          f"{'restart s':>10}")
    for name, m in measured.items():
        c = costs_of(m, restart[name], 1.0)
        print(f"{name:<7}{m['params'] / 1e6:>7.1f}M{c.step_s:>9.3f}{c.record_s:>10.4f}{c.stall_s:>9.4f}"
              f"{c.persist_s:>10.3f}{c.full_bytes / 1e6:>9.1f}{c.batch_fixed_s:>12.4f}"
              f"{c.diff_bytes_per_step / 1e6:>9.2f}"
              f"{c.write_bytes_per_s / 1e6:>11.0f}{c.replay_s:>10.4f}{m['controller']['replay_s']:>10.4f}"
              f"{c.load_s:>8.3f}{c.restart_s:>10.2f}")
    with open(os.path.join(args.out, "tune_measured.json"), "w") as f:
        json.dump({"measured": measured, "restart_s": restart}, f, indent=1)
    rows = run_simulation(profiles(measured, restart, args.slow_factor), 300 if args.quick else 3000, args.seed,
                          args.out)
    met = print_simulation(rows)
    print(f"simulation target (controller within 5% of the best grid point, below Young/Daly and CheckFreq "
          f"full-only): {'met in every profile' if met else 'MISSED in some profile (see above)'}")
    _plot(rows, args.out)
    if not args.skip_real:
        real = run_real(args, args.out)
        best = max(r["goodput_steps_per_s"] for r in real if r["settings"] != "auto/auto")
        auto = next(r["goodput_steps_per_s"] for r in real if r["settings"] == "auto/auto")
        verdict = "met" if auto >= 0.95 * best else "MISSED"
        print(f"real-run target (auto within 5% of the best fixed goodput): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
