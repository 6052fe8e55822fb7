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
3. real: train in a child process, SIGKILL it at exponentially distributed times (short MTBF;
   the lives drawn stratified, experiments/lifelog.py), restart with resume; each life's events
   (start, resume, step ends, kill) kept in a timeline for the scale model's validation; goodput
   (durable steps per wall-clock second) of "auto" and of fixed settings (with and without
   differentials) under the same failure times. "auto" keeps its measurements across restarts
   (CONTROLLER.json).

Prints fixed-width tables, writes CSVs to --out, and plots when matplotlib is installed.
``--quick`` finishes in under five minutes. Slow storage is the measured fast storage with every
I/O time (persist, batch write, load, read during replay) multiplied by --slow-factor: this machine
has one disk, and tmpfs is no faster than it for these sizes.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
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
import lifelog  # noqa: E402

import lowdiff  # noqa: E402
import recovery  # noqa: E402
from lowdiff.control.costmodel import (  # noqa: E402
    Costs,
    Evaluation,
    Limits,
    checkfreq_full_every,
    evaluate,
    solve,
    young_daly_full_every,
)
from lowdiff.control.meter import CostMeter  # noqa: E402
from lowdiff.control.policy import LEARNING_FULL_COSTS, PROBE_WARMUP, Measured, Policy  # noqa: E402
from lowdiff.step.compress import decompress_into  # noqa: E402
from lowdiff.store.inventory import take_inventory  # noqa: E402

LARGE = gpt.GPTConfig(n_layer=8, n_head=8, n_embd=512, vocab_size=16384, block_size=128, seq_len=128,
                      batch_size=4)
# --quick: a smaller "large" model (8.8M parameters, 1.7x the small one; the 33.7M one takes
# minutes to measure on a loaded 2-core machine). The measured table prints the parameter count.
LARGE_QUICK = gpt.GPTConfig(n_layer=4, n_head=5, n_embd=320, vocab_size=12288, block_size=128, seq_len=128,
                            batch_size=4)
MODELS = {"small": gpt.PRESETS["quick"], "large": LARGE_QUICK if os.environ.get("TUNE_FREQUENCY_QUICK") else LARGE}
GRID_B = (1, 2, 4, 8, 16, 32, 64)
REAL_SETTINGS = ("auto", "auto-diffs", "10/1", "50/4", "200/16", "10/off", "40/off")
REAL_SETTINGS_QUICK = ("auto", "50/4", "10/off")


# ------------------------------------------------------------------ 1. measure
FULL_ONLY_EVERY = 4      # measure(): the interval of the full-only run (its per-step cost amortises S)
WARMUP_EXTRA = 3         # base checkpoint at step 1, then fulls (and batches) at 5, 9, ...: 2nd step of a block


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
    every FULL_ONLY_EVERY steps — take turns in blocks of FULL_ONLY_EVERY steps (in a rotating
    order), ``rounds`` times, so the machine's changing load falls on all three alike; what a
    checkpointing trainer's block takes longer than the plain one's of the same round (the median
    over rounds: one round hit by a burst of load moves nothing) is what its checkpointing costs.
    Then the differential run is resumed
    (a chain of all its steps) and its load and replay times taken from recovery.resume."""
    cfg = MODELS[name]
    directories = {kind: tempfile.mkdtemp(prefix=f"tune-{name}-{kind}-", dir=root) for kind in ("diffs", "fulls")}
    options = {"plain": None, "diffs": {"full_every": 10**6, "batch_steps": 4},
               "fulls": {"schedule": lowdiff.Fixed(full_every=FULL_ONLY_EVERY, differentials=False)}}
    trainers = {}
    for kind, wrap_options in options.items():
        model = gpt.build_model(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        if wrap_options is not None:
            opt = lowdiff.wrap(opt, model, directories[kind], compressor=COMPRESSORS[compressor], **wrap_options)
        trainers[kind] = (model, opt)
    steps: dict[str, int] = dict.fromkeys(trainers, 0)
    spent: dict[str, list[float]] = {kind: [] for kind in trainers}
    sparse = COMPRESSORS[compressor] if compressor != "dense" else None
    kinds = list(trainers)
    for block in range(rounds + 1):          # the first block warms up (base checkpoint, optimizer state)
        for kind in kinds[block % 3:] + kinds[:block % 3]:
            model, opt = trainers[kind]
            started = time.perf_counter()
            # The warm-up's WARMUP_EXTRA steps put each later block's full checkpoint (and batch
            # write) at its second step: their background work overlaps the same trainer's block,
            # not the next trainer's.
            for _ in range(FULL_ONLY_EVERY + (0 if block else WARMUP_EXTRA)):
                _step(cfg, model, opt, steps[kind], sparse if kind == "plain" else None)
                steps[kind] += 1
            if block:
                spent[kind].append(time.perf_counter() - started)
    plain_s = float(np.median(spent["plain"])) / FULL_ONLY_EVERY
    per_step = {"plain": plain_s, **{kind: plain_s + float(np.median(np.subtract(spent[kind], spent["plain"])))
                                     / FULL_ONLY_EVERY for kind in ("diffs", "fulls")}}
    seen, full_only_stall_s = {}, 0.0
    for kind in ("diffs", "fulls"):
        opt = trainers[kind][1]
        opt.flush()
        stats = opt.stats()
        seen[kind] = stats["controller"]["costs"]
        if kind == "fulls":
            full_only_stall_s = (stats["full_stall_median_ms"] or 0.0) / 1e3
        opt.close()
    model2 = gpt.build_model(cfg)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-4)
    resumed = recovery.resume(directories["diffs"], model2, opt2)
    for directory in directories.values():
        shutil.rmtree(directory)
    return {"model": name, "compressor": compressor, "params": trainers["plain"][0].num_params(),
            "base_step_s": per_step["plain"],
            "diff_step_s": per_step["diffs"], "full_only_step_s": per_step["fulls"], "controller": seen["diffs"],
            "controller_full_only": seen["fulls"], "full_only_stall_s": full_only_stall_s,
            "resume_load_s": resumed.load_s,
            "resume_replay_s_per_step": resumed.replay_s / max(resumed.replayed, 1), "replayed": resumed.replayed}


def measure_restart() -> dict[str, float]:
    """A restarted trainer's time to its first resume call, per model: interpreter and imports (one
    new interpreter for all models), plus that model's build (timed in it)."""
    code = ("import sys, time, json; sys.path.insert(0, 'experiments'); import torch, lowdiff, recovery, gpt; "
            "import tune_frequency as t2; out = {}\n"
            "for name, cfg in t2.MODELS.items():\n"
            "    started = time.perf_counter(); gpt.build_model(cfg); out[name] = time.perf_counter() - started\n"
            "print(json.dumps(out))")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, cwd=_repo())
    builds = json.loads(done.stdout.decode().strip().splitlines()[-1])
    start_s = time.perf_counter() - started - sum(builds.values())
    return {name: start_s + build_s for name, build_s in builds.items()}


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
    # (The controller's own S holds the interval of the step after a full checkpoint, which in
    # measure() spans the other trainers' blocks: its raw stall is taken instead.)
    full_s = max(m["full_only_stall_s"], (m["full_only_step_s"] - m["base_step_s"]) * FULL_ONLY_EVERY)
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
        if g + 1 >= len(gaps):
            return math.inf     # more failures than drawn: this setting barely progresses
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
            if g >= len(gaps):
                return math.inf
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


def controller_choice(c: Costs, limits: Limits, differentials: bool | str) -> Evaluation:
    """The setting the controller's own policy (lowdiff.control.policy, the code a training run
    executes) takes for costs ``c``: full_every and batch_steps "auto", ``differentials`` as given
    ("auto": it may choose full checkpoints only), every cost measured and its learning phase over
    (as many full checkpoints' costs and probes as it waits for), so nothing limits its decision."""
    policy = Policy(limits, full_every="auto", batch_steps="auto", differentials=differentials)
    measured = Measured(c, differentials_measured=True, full_costs=LEARNING_FULL_COSTS, probes=PROBE_WARMUP)
    if policy.resolve(measured, "simulation", time_s=0.0) is None or policy.current is None:
        raise AssertionError("the policy's first decision is always applied")
    return policy.current


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
        chosen = {"controller": controller_choice(c, limits, "auto"),   # may choose full checkpoints only
                  "controller-diffs": controller_choice(c, limits, True)}  # differentials kept
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
          f"{'ctl/best':>9}{'Young-full':>11}{'F':>6}{'CheckFreq':>10}{'ctl-diffs':>10}{'F/B':>9}{'model %':>9}"
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
        # Where full checkpoints alone are best, the controller takes about Young/Daly's interval
        # too: the same policy, a tie (a few % either way is the simulation's noise: moving F by a
        # step moves where the same failures land within the interval).
        tie = ctl["batch_steps"] == "-" and ctl["wasted_h"] <= 1.05 * young["wasted_h"] and \
            ctl["wasted_h"] <= cf["wasted_h"]
        met = near_best and below
        met_all &= near_best and (below or tie)
        verdict = "met" if met else ("tie (full-only)" if near_best and tie else "MISSED")
        print(f"{profile:<24}{str(ctl['full_every']) + '/' + str(ctl['batch_steps']):>15}{ctl['wasted_h']:>10.2f}"
              f"{str(grid['full_every']) + '/' + str(grid['batch_steps']):>15}{grid['wasted_h']:>10.2f}"
              f"{ctl['wasted_h'] / grid['wasted_h']:>9.3f}{young['wasted_h']:>11.2f}{young['full_every']:>6}"
              f"{cf['wasted_h']:>10.2f}"
              f"{kept['wasted_h']:>10.2f}{str(kept['full_every']) + '/' + str(kept['batch_steps']):>9}"
              f"{ctl['model_waste_pct']:>9.3f}{ctl['waste_pct']:>8.3f}  {verdict}")
    return met_all


# ------------------------------------------------------------------ 3. real run
def child(directory: str, settings: str, rate_per_hour: float, steps: int, model_name: str, quiet: bool,
          log_path: str, timeline: str) -> None:
    """The trainer the driver kills: resume, train to ``steps``, print each step (unless ``quiet``);
    the controller's decisions (logger "lowdiff") are appended to ``log_path``, its resume and the
    end of each step (with the settings in force) to ``timeline`` (experiments/lifelog.py)."""
    if quiet:   # a forked child shares the driver's stdout
        sys.stdout = open(os.devnull, "w")
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter(f"%(asctime)s pid {os.getpid()} %(message)s"))
    logging.getLogger("lowdiff").addHandler(handler)
    logging.getLogger("lowdiff").setLevel(logging.INFO)
    torch.set_num_threads(1)
    cfg = MODELS[model_name]
    model = gpt.build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    opt = lowdiff.wrap(opt, model, directory, compressor=lowdiff.Dense(), schedule=schedule(settings, rate_per_hour))
    start = recovery.resume(directory, model, opt)
    lifelog.write(timeline, "resumed", start.load_s, start.replay_s, start.replayed)
    print(f"resumed {start}", flush=True)
    controller = opt.controller
    for step in range(start, steps):
        x, y = gpt.batch(cfg, step)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        lifelog.write(timeline, "step",
                      f"{controller.full_every}/{controller.batch_steps if controller.differentials_wanted else 'off'}")
        print(f"step {step + 1}", flush=True)
    opt.close()


def schedule(settings: str, rate_per_hour: float) -> lowdiff.Auto | lowdiff.Fixed:
    """"auto": everything auto, differentials included (consent given); "auto-diffs": full_every
    and batch_steps auto, differentials kept; "F/B": fixed; "F/off": full checkpoints only."""
    if settings == "auto":
        return lowdiff.Auto(differentials="auto", failure_rate_per_hour=rate_per_hour)
    if settings == "auto-diffs":
        return lowdiff.Auto(failure_rate_per_hour=rate_per_hour)
    full, batch = settings.split("/")
    if batch == "off":
        return lowdiff.Fixed(full_every=int(full), differentials=False)
    return lowdiff.Fixed(full_every=int(full), batch_steps=int(batch))


class Launcher:
    """Starts trainers: "exec" runs a new interpreter per life (imports, model build: seconds on a
    loaded machine, and varying); "fork" forks each from a server that has imported torch, lowdiff
    and recovery already (multiprocessing's forkserver), so a restart costs what the settings make
    it cost (model build, wrap, resume) and little else — the same for every setting either way,
    but the exec restart's noise can swamp the differences between settings."""

    def __init__(self, how: str):
        self.how = how
        if how == "fork":
            import multiprocessing

            self._context = multiprocessing.get_context("forkserver")
            # (Python 3.11's forkserver imports neither "__main__" nor anything outside its default
            # sys.path; the child then imports this script, whose heavy imports are these.)
            self._context.set_forkserver_preload(["numpy", "torch", "lowdiff", "recovery"])
            warm = self._context.Process(target=time.sleep, args=(0,))   # start the server now, not in a life
            warm.start()
            warm.join()

    def start(self, directory: str, settings: str, rate_per_hour: float, model: str, log_path: str, timeline: str):
        if self.how == "fork":
            proc = self._context.Process(target=child, args=(directory, settings, rate_per_hour, 10**8, model, True,
                                                             log_path, timeline))
            proc.start()
            return proc
        command = [sys.executable, os.path.abspath(__file__), "--child", directory, settings, str(rate_per_hour),
                   "100000000", model, log_path, timeline]
        return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=_repo())

    def kill_after(self, proc, life_s: float, timeline: str) -> None:
        """Let ``proc`` live ``life_s`` seconds, then SIGKILL it (and reap it); the moment of the
        kill goes to ``timeline`` (the reaping after it is part of the restart a kill costs)."""
        if self.how == "fork":
            proc.join(timeout=life_s)
            if proc.is_alive():
                lifelog.write(timeline, "kill")
                os.kill(proc.pid, signal.SIGKILL)
            proc.join()
            return
        try:
            proc.wait(timeout=life_s)
        except subprocess.TimeoutExpired:
            lifelog.write(timeline, "kill")
            proc.send_signal(signal.SIGKILL)
            proc.wait()


def real_round(launcher: Launcher, settings_list: list[str], lives: list[float], mtbf_s: float, model: str,
               root: str, log_prefix: str) -> list[dict]:
    """One round: each setting trains in lives of the same lengths (``lives``): a trainer is started,
    SIGKILLed when its life ends, restarted with resume. The settings take turns life by life (in a
    rotating order), so a change in the machine's load falls on all of them alike. Goodput =
    durable steps at the end / wall time. The controller's decisions go to
    ``log_prefix``-SETTINGS.log, each life's events to ``log_prefix``-SETTINGS.timeline, summarised
    in the row's "timeline" (experiments/lifelog.py: what the run spent, for the scale model)."""
    directories = {s: tempfile.mkdtemp(prefix="tune-real-", dir=root) for s in settings_list}
    for index, life_s in enumerate(lives):
        # The order rotates, so no setting always starts right after the same one was killed.
        turn = index % len(settings_list)
        for settings in settings_list[turn:] + settings_list[:turn]:
            log_path = f"{log_prefix}-{settings.replace('/', '_')}.log"
            timeline = log_path[:-len(".log")] + ".timeline"
            lifelog.write(timeline, "life")
            proc = launcher.start(directories[settings], settings, 3600 / mtbf_s, model, log_path, timeline)
            launcher.kill_after(proc, life_s, timeline)
            lifelog.write(timeline, "end")
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
            ratio = kept["samples"].get("record_ratio") or [math.nan]
            record_ratio = float(np.median(ratio))
        except (OSError, ValueError, KeyError):
            restart_s = record_ratio = math.nan
        # The costs the trainers measured in this very run (same load, same disk), for the scale
        # model's validation (experiments/scale_model.py --validate).
        meter = CostMeter()
        try:
            meter.load(directory)
            in_run = meter.costs(not (chosen or settings).endswith("/off"))
        except ValueError:
            in_run = None
        shutil.rmtree(directory)
        timeline = f"{log_prefix}-{settings.replace('/', '_')}.timeline"
        spent = lifelog.summarize(lifelog.read(timeline))
        rows.append({"settings": settings, "last_in_force": chosen or settings, "durable_steps": durable,
                     "wall_s": sum(lives), "kills": len(lives) - 1, "restart_s": restart_s,
                     "record_ratio": record_ratio, "goodput_steps_per_s": durable / sum(lives),
                     "in_run_costs": json.dumps(dataclasses.asdict(in_run)) if in_run is not None else "",
                     "timeline": json.dumps(spent)})
    return rows


def run_real(args, out_dir: str) -> list[dict]:
    """``args.rounds`` rounds, each with its own failure times (the same for every setting in it)."""
    launcher = Launcher(args.restart)
    rows = []
    for r in range(args.rounds):
        lives = lifelog.stratified_lives(np.random.default_rng(args.seed + 1000 + r), args.mtbf_s, args.real_budget_s)
        log_prefix = os.path.join(out_dir, f"tune_real_round{r}")
        for name in os.listdir(out_dir):
            if name.startswith(f"tune_real_round{r}-"):
                os.unlink(os.path.join(out_dir, name))
        for row in real_round(launcher, args.real_settings, lives, args.mtbf_s, "small", args.root, log_prefix):
            rows.append({"round": r, "load_avg_1m": os.getloadavg()[0], **row})
        print(f"(round {r + 1} of {args.rounds} done, load average {os.getloadavg()[0]:.1f})", flush=True)
    _write_csv(os.path.join(out_dir, "tune_real.csv"), rows)
    import plotting  # experiments/plotting.py: the figure, drawn from the CSV alone
    print(plotting.try_draw(os.path.join(out_dir, "tune_real.csv")))
    print_real(rows, args)
    return rows


def real_summary(rows: list[dict]) -> dict[str, dict]:
    """Per setting: goodput per round, its mean, and per round its ratio to that round's best fixed."""
    rounds = sorted({r["round"] for r in rows})
    out: dict[str, dict] = {}
    for settings in dict.fromkeys(r["settings"] for r in rows):
        per_round = [next(x["goodput_steps_per_s"] for x in rows if x["round"] == k and x["settings"] == settings)
                     for k in rounds]
        best_fixed = [max(x["goodput_steps_per_s"] for x in rows if x["round"] == k and
                          not x["settings"].startswith("auto")) for k in rounds]
        mine = [x for x in rows if x["settings"] == settings]
        out[settings] = {"goodput": per_round, "mean": float(np.mean(per_round)),
                         "ratios": [g / b for g, b in zip(per_round, best_fixed)], "rows": mine}
    return out


def _median_or_dash(values: list[float]) -> str:
    known = [v for v in values if not math.isnan(v)]
    return f"{float(np.median(known)):.3f}" if known else "-"


def print_real(rows: list[dict], args) -> None:
    summary = real_summary(rows)
    best_name = max((s for s in summary if not s.startswith("auto")), key=lambda s: summary[s]["mean"])
    best_mean = summary[best_name]["mean"]
    print(f"\nreal run: small model, Dense, SIGKILL after exponential gaps (MTBF {args.mtbf_s:g} s, stratified), "
          f"{args.rounds} round(s) of {args.real_budget_s:g} s per setting, each round its own failure times, "
          f"the same for every setting; restarts by {args.restart}; auto told {3600 / args.mtbf_s:g} failures/h; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'settings':<12}{'in force':>10}{'steps/round':>12}{'kills':>7}{'restart s':>10}{'rec ratio':>10}"
          f"{'goodput/s':>11}{'min..max':>15}{'vs best fixed':>15}{'per-round ratio':>18}")
    for settings, s in summary.items():
        mine = s["rows"]
        ratios = s["ratios"]
        print(f"{settings:<12}{mine[-1]['last_in_force']:>10}{np.mean([m['durable_steps'] for m in mine]):>12.0f}"
              f"{np.mean([m['kills'] for m in mine]):>7.0f}{np.nanmedian([m['restart_s'] for m in mine]):>10.2f}"
              f"{_median_or_dash([m['record_ratio'] for m in mine]):>10}{s['mean']:>11.3f}"
              f"{min(s['goodput']):>7.3f}..{max(s['goodput']):<6.3f}{s['mean'] / best_mean:>15.3f}"
              f"{min(ratios):>9.3f}..{max(ratios):<7.3f}")
    print(f"(best fixed by mean goodput: {best_name}; per-round ratio: goodput / that round's best fixed)")


# ------------------------------------------------------------------ main
def _write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, failures and a shorter real run (<5 min)")
    parser.add_argument("--root", default=os.getcwd(), help="where checkpoints are written (the storage measured)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="directory for the CSVs, logs and plots (default: experiments/results)")
    parser.add_argument("--slow-factor", type=float, default=10.0, help="slow storage: I/O times multiplied by this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtbf-s", type=float, default=20.0, help="real run: mean time between SIGKILLs")
    parser.add_argument("--real-budget-s", type=float, help="real run: wall time per setting")
    parser.add_argument("--real-settings", nargs="+",
                        help='"auto", "auto-diffs" (differentials kept), "F/B" or "F/off" (full checkpoints only); '
                             'default: ' + " ".join(REAL_SETTINGS) + "; --quick: " + " ".join(REAL_SETTINGS_QUICK))
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--real-only", action="store_true", help="only the real run (no measurement, no simulation)")
    parser.add_argument("--compressors", nargs="+", default=list(COMPRESSORS), choices=list(COMPRESSORS),
                        help="the differentials' compressors measured (the real run uses Dense)")
    parser.add_argument("--rounds", type=int, help="real run: rounds, each with its own failure times (default 3, "
                        "--quick 1)")
    parser.add_argument("--restart", choices=("fork", "exec"), default="fork",
                        help="real run: restart a killed trainer by forking it from a server that has imported "
                             "torch and lowdiff (default), or by running a new interpreter")
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        directory, settings, rate, steps, model, log_path, timeline = args.child
        child(directory, settings, float(rate), int(steps), model, False, log_path, timeline)
        return 0
    if args.quick:   # (an environment variable: measure_restart's interpreter builds the same models)
        os.environ["TUNE_FREQUENCY_QUICK"] = "1"
        MODELS["large"] = LARGE_QUICK
    if args.real_budget_s is None:
        args.real_budget_s = 20.0 if args.quick else 90.0
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.real_settings is None:
        args.real_settings = list(REAL_SETTINGS_QUICK if args.quick else REAL_SETTINGS)
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
    restart = measure_restart()
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
    rows = run_simulation(profiles(measured, restart, args.slow_factor), 1000 if args.quick else 3000, args.seed,
                          args.out)
    met = print_simulation(rows)
    print(f"simulation target (controller within 5% of the best grid point, below Young/Daly and CheckFreq "
          f"full-only): {'met in every profile' if met else 'MISSED in some profile (see above)'} (tie: full "
          f"checkpoints only are optimal there, and the controller, with consent to drop differentials, takes "
          f"Young/Daly's interval too — it cannot beat it, and does not lose to it)")
    print("(controller: differentials='auto', may choose full checkpoints only, F/-; ctl-diffs: the controller "
          "keeping differentials; grid: F x B in " + str(GRID_B) + " and F/- without differentials)")
    import plotting  # experiments/plotting.py: the figure, drawn from the CSV alone
    print(plotting.try_draw(os.path.join(args.out, "tune_simulation.csv")))
    if not args.skip_real:
        _real_verdict(run_real(args, args.out))
    return 0


def _real_verdict(real: list[dict]) -> int:
    summary = real_summary(real)
    if "auto" not in summary:
        return 0
    best_mean = max(s["mean"] for name, s in summary.items() if not name.startswith("auto"))
    ratio = summary["auto"]["mean"] / best_mean
    per_round = summary["auto"]["ratios"]
    spread = f"per round {min(per_round):.3f}..{max(per_round):.3f}"
    if len(per_round) > 1:
        sem = np.std(per_round, ddof=1) / math.sqrt(len(per_round))
        spread += f", mean {np.mean(per_round):.3f} +- {sem:.3f} (s.e.)"
    print(f"real-run target (auto's mean goodput within 5% of the best fixed setting's): "
          f"{'met' if ratio >= 0.95 else 'MISSED'} ({ratio:.3f}; {spread})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
