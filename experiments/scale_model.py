"""The scale model (issue #28): what checkpointing strategies cost a training job of 1k-16k GPUs per
day, on paper, driven by the controller's own cost model and by costs lowdiff measures.

No formula of waste here: every strategy is turned into the per-rank inputs of
``lowdiff.control.costmodel`` (``Costs``, ``Limits``) and evaluated by its ``evaluate``, its
interval chosen by its ``solve``/``young_daly_full_every``/``checkfreq_full_every``, as the online
controller does. What this module adds is the cluster around one rank:

- each rank's share of the shared storage: every rank writes its part of a checkpoint at the same
  moment, so a rank gets ``shared_bytes_per_s / gpus`` (and ``local_node_bytes_per_s /
  gpus_per_node`` of its node's disk when staging);
- saturation: the bytes the job sends to shared storage in one full-checkpoint interval, at the
  shared bandwidth, may take longer than the interval; training then waits for the storage (the
  next checkpoint cannot start before the last one is out: DCP's one save in flight, lowdiff's
  drainer backpressure), and that wait is charged as a stall per checkpoint (``saturation_wait_s``);
- the failure rate of the job (MTBF per job, or per GPU divided by the GPUs);
- per day: failures, lost work, recovery (restart + load + replay), stalls, shared-storage traffic
  against its bandwidth, and the effective training time.

Inputs, each with its source, are printed before the tables. ``--stats FILE`` takes
the per-rank ratios lowdiff measured (a saved ``opt.stats()`` or CONTROLLER.json); ``--validate
DIR`` compares the model with the real SIGKILL runs of experiments/tune_frequency.py saved in DIR
(tune_real.csv with each setting's timeline, and tune_measured.json when the measurement phase
ran). Writes CSVs and figures (experiments/plotting.py) to --out.

    python experiments/scale_model.py [--validate experiments/results] [--out experiments/results]
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # lowdiff from the checkout
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))                    # plotting, tune_frequency

from lowdiff.control.costmodel import (  # noqa: E402
    Costs,
    Evaluation,
    Limits,
    checkfreq_full_every,
    evaluate,
    solve,
    young_daly_full_every,
)

DAY_S = 86_400.0
HOUR_S = 3_600.0


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A training job. Sizes in bytes, bandwidths in bytes/s, times in seconds."""

    name: str
    gpus: int
    params: float
    step_s: float
    job_mtbf_s: float
    shared_bytes_per_s: float
    gpus_per_node: int = 8
    local_node_bytes_per_s: float = 10e9
    shared_read_bytes_per_s: float | None = None   # None: the write bandwidth
    restart_s: float = 600.0
    state_bytes_per_param: float = 14.0   # bf16 weights + fp32 master weights + fp32 Adam m and v
    grad_bytes_per_param: float = 4.0     # the gradient the optimizer consumes (fp32)
    snapshot_bytes_per_s: float = 20e9    # device -> pinned host copy of a rank's state
    hbm_bytes_per_s: float = 2e12         # an optimizer step is memory-bound on the GPU
    sharding: str = "fsdp"                # "fsdp": a rank holds 1/gpus of the state; "ddp": all of it

    def __post_init__(self):
        if self.sharding not in ("fsdp", "ddp"):
            raise ValueError(f"Cluster.sharding={self.sharding!r} must be 'fsdp' or 'ddp'")
        for name in ("gpus", "params", "step_s", "job_mtbf_s", "shared_bytes_per_s", "gpus_per_node",
                     "local_node_bytes_per_s", "snapshot_bytes_per_s", "hbm_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster.{name}={getattr(self, name)!r} must be > 0")

    @property
    def state_bytes(self) -> float:
        return self.params * self.state_bytes_per_param

    @property
    def rank_state_bytes(self) -> float:
        """What one rank holds (and what its optimizer step and replay touch)."""
        return self.state_bytes / self.gpus if self.sharding == "fsdp" else self.state_bytes

    @property
    def rank_write_bytes(self) -> float:
        """A rank's part of a full checkpoint: one copy of the state, split over the ranks."""
        return self.state_bytes / self.gpus

    @property
    def shared_share(self) -> float:
        return self.shared_bytes_per_s / self.gpus

    @property
    def read_share(self) -> float:
        return (self.shared_read_bytes_per_s or self.shared_bytes_per_s) / self.gpus

    @property
    def local_share(self) -> float:
        return self.local_node_bytes_per_s / self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Measured:
    """Per-rank costs lowdiff measures, as ratios that carry from one machine to another.

    record_frac: what recording a differential adds to a step, as a fraction of the step.
    batch_fixed_s: the fixed cost of one differential batch commit (fdatasync, rename, manifest).
    topk_ratio / index_bytes: TopK's kept fraction and its index bytes per kept entry.
    """

    record_frac: float = 0.016
    batch_fixed_s: float = 0.05
    topk_ratio: float = 0.01
    index_bytes: float = 2.0


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How a job checkpoints. ``diffs``: None (full checkpoints only), "topk" or "dense";
    ``interval``: how F is chosen — "young-daly", "best" (least waste, saturation included),
    "checkfreq", "controller" (lowdiff's solve), "auto" (solve with differentials="auto")."""

    name: str
    interval: str
    diffs: str | None = None
    sync: bool = False
    staged: bool = False


STRATEGIES = (
    Strategy("sync full, Young/Daly", "young-daly", sync=True),
    Strategy("DCP-style async full", "best"),
    Strategy("CheckFreq", "checkfreq"),
    Strategy("lowdiff TopK", "controller", diffs="topk"),
    Strategy("lowdiff TopK, staged", "controller", diffs="topk", staged=True),
    Strategy("lowdiff Dense", "controller", diffs="dense"),
    Strategy("lowdiff Dense, staged", "controller", diffs="dense", staged=True),
    Strategy("lowdiff Dense, auto", "auto", diffs="dense"),
)


def diff_rank_bytes(cluster: Cluster, measured: Measured, diffs: str | None) -> float:
    """One step's differential of one rank: its shard of the gradient (FSDP) or its part of the
    one copy a DDP job writes, dense or TopK (value + index bytes per kept entry)."""
    if diffs is None:
        return 0.0
    per_param = cluster.grad_bytes_per_param
    if diffs == "topk":
        per_param = measured.topk_ratio * (cluster.grad_bytes_per_param + measured.index_bytes)
    elif diffs != "dense":
        raise ValueError(f"diffs={diffs!r} must be None, 'topk' or 'dense'")
    return cluster.params * per_param / cluster.gpus


def rank_costs(cluster: Cluster, measured: Measured, strategy: Strategy) -> Costs:
    """The cost model's inputs for one rank of ``cluster`` under ``strategy``. Writes go to the
    rank's share of the shared storage, or with staging to its share of the node's disk (the
    durable point the model counts is still the shared copy: a failed node's disk is assumed gone,
    so the persist time is the local write plus the drain); resume reads the shared storage."""
    write_s = cluster.rank_write_bytes / cluster.shared_share
    snapshot_s = cluster.rank_state_bytes / cluster.snapshot_bytes_per_s
    diff_bytes = diff_rank_bytes(cluster, measured, strategy.diffs)
    opt_step_s = 3 * cluster.rank_state_bytes / cluster.hbm_bytes_per_s   # read state + grad, write state
    replay_s = diff_bytes / cluster.read_share + opt_step_s if strategy.diffs else 0.0
    path_bytes_per_s = cluster.local_share if strategy.staged else cluster.shared_share
    persist_s = cluster.rank_write_bytes / path_bytes_per_s + (write_s if strategy.staged else 0.0)
    return Costs(step_s=cluster.step_s,
                 stall_s=snapshot_s + (write_s if strategy.sync else 0.0),
                 persist_s=0.0 if strategy.sync else persist_s,
                 replay_s=replay_s,
                 load_s=cluster.rank_write_bytes / cluster.read_share,
                 record_s=measured.record_frac * cluster.step_s if strategy.diffs else 0.0,
                 full_bytes=cluster.rank_write_bytes,
                 batch_fixed_s=measured.batch_fixed_s if strategy.diffs else 0.0,
                 diff_bytes_per_step=diff_bytes,
                 write_bytes_per_s=path_bytes_per_s,
                 restart_s=cluster.restart_s)


def base_step_s(costs: Costs, e: Evaluation) -> float:
    """A step's wall time without the full checkpoints' stall, as ``evaluate`` computed it (read
    back from its overhead, so this module repeats none of its formula)."""
    return costs.step_s / (1.0 - e.overhead) - costs.stall_s / e.full_every


def saturation_wait_s(cluster: Cluster, costs: Costs, e: Evaluation) -> float:
    """How long training waits per full checkpoint for the shared storage: the job's bytes of one
    interval (a full checkpoint and, with differentials, F steps of them) take
    bytes / shared bandwidth; the interval lasts F base steps plus the stall. Nothing waits when
    the storage keeps up, or when checkpoints are synchronous (their write is the stall already)."""
    if costs.persist_s == 0.0:
        return 0.0
    diff_bytes = costs.diff_bytes_per_step if e.batch_steps is not None else 0.0   # none recorded
    interval_bytes = cluster.gpus * (costs.full_bytes + e.full_every * diff_bytes)
    fabric_s = interval_bytes / cluster.shared_bytes_per_s
    interval_s = e.full_every * base_step_s(costs, e) + costs.stall_s
    return max(0.0, fabric_s - interval_s)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One strategy on one cluster: the model's answer, per day where it says so."""

    strategy: str
    full_every: int
    batch_steps: int | None
    effective: float          # fraction of wall-clock time spent on steps that are kept
    failures_per_day: float
    lost_h: float             # work redone per day (steps after the last durable state)
    recovery_h: float         # restart + load + replay (+ the base checkpoint) per day
    stall_h: float            # checkpoint stalls and waits for the storage per day
    traffic_tb: float         # bytes written to shared storage per day (TB)
    fabric_busy: float        # that traffic over what the shared bandwidth can carry in a day
    wait_s: float             # saturation wait per full checkpoint
    per_failure_s: float


def settle(cluster: Cluster, costs: Costs, limits: Limits, full_every: int,
           batch_steps: int | None) -> tuple[Evaluation, Costs, float]:
    """``evaluate`` with the saturation wait charged as stall (the wait depends on the step time,
    which depends on the stall: a fixed point, reached in a few rounds)."""
    wait_s, charged = 0.0, costs
    for _ in range(20):
        charged = dataclasses.replace(costs, stall_s=costs.stall_s + wait_s)
        e = evaluate(charged, limits, full_every, batch_steps)
        new_wait = saturation_wait_s(cluster, charged, e) + wait_s
        if abs(new_wait - wait_s) <= 1e-9 * max(1.0, wait_s):
            break
        wait_s = new_wait
    return e, charged, wait_s


def _full_every_grid(around: list[int]) -> list[int]:
    grid = {max(1, round(10 ** (k / 8))) for k in range(0, 8 * 6 + 1)}   # 1 .. 10^6, 8 per decade
    return sorted(grid | {f for f in around if f >= 1})


def choose(cluster: Cluster, costs: Costs, limits: Limits, strategy: Strategy) -> tuple[int, int | None]:
    """The strategy's (full_every, batch_steps) by its own rule."""
    if strategy.interval == "young-daly":
        return young_daly_full_every(costs, limits), None
    if strategy.interval == "checkfreq":
        return checkfreq_full_every(costs), None
    if strategy.interval in ("controller", "auto"):
        e = solve(costs, limits, differentials="auto" if strategy.interval == "auto" else True)
        return e.full_every, e.batch_steps
    if strategy.interval == "best":   # the best interval with the storage's saturation included
        start = solve(costs, limits, differentials=False).full_every
        grid = _full_every_grid([start])
        return min(grid, key=lambda f: settle(cluster, costs, limits, f, None)[0].waste), None
    raise ValueError(f"Strategy.interval={strategy.interval!r}")


def assess(cluster: Cluster, measured: Measured, strategy: Strategy, limits: Limits | None = None) -> Outcome:
    """The model's answer for ``strategy`` on ``cluster``."""
    limits = limits or Limits(failure_rate_per_s=1.0 / cluster.job_mtbf_s)
    costs = rank_costs(cluster, measured, strategy)
    full_every, batch_steps = choose(cluster, costs, limits, strategy)
    e, charged, wait_s = settle(cluster, costs, limits, full_every, batch_steps)
    lost_share = 1.0 - (1.0 - e.waste) / (1.0 - e.overhead)
    # The parts of one failure, from the model itself: the time its session spends restarting,
    # loading, replaying and taking its base checkpoint (cut short when the next failure comes
    # first), and the work it loses.
    recovery_s = e.recovery_s
    lost_s = e.per_failure_s - recovery_s
    failures = lost_share * DAY_S / e.per_failure_s if e.per_failure_s > 0 else 0.0
    step_wall_s = charged.step_s / (1.0 - e.overhead)            # a step with fulls amortised
    steps_per_day = DAY_S * (1.0 - lost_share) / step_wall_s     # steps run (kept or redone later)
    diff_bytes = charged.diff_bytes_per_step if batch_steps is not None else 0.0   # "auto" may turn them off
    per_step_bytes = cluster.gpus * (charged.full_bytes / full_every + diff_bytes)
    traffic = steps_per_day * per_step_bytes
    return Outcome(strategy.name, full_every, batch_steps, 1.0 - e.waste, failures,
                   failures * lost_s / HOUR_S, failures * recovery_s / HOUR_S,
                   DAY_S * e.overhead * (1.0 - lost_share) / HOUR_S, traffic / 1e12,
                   traffic / (cluster.shared_bytes_per_s * DAY_S), wait_s, e.per_failure_s)


# ------------------------------------------------------------------ configurations and their sources
H100_BF16_S = 400e12        # achieved bf16 FLOP/s per GPU at ~40% MFU (Llama 3 paper: 38-43% MFU on H100)
LLAMA3_MTBF_S = 54 * DAY_S / 419   # 419 unexpected interruptions in 54 days (Llama 3 paper, sec. 3.3.4)
PER_GPU_MTBF_S = LLAMA3_MTBF_S * 16_384


def step_time_s(params: float, tokens_per_gpu: float) -> float:
    """6 x params FLOPs per token (dense transformer, forward + backward) at H100_BF16_S."""
    return 6 * params * tokens_per_gpu / H100_BF16_S


def clusters() -> list[Cluster]:
    """Llama-3-405B-like (16,384 H100s, 16M tokens a step, 2 TB/s) and 1k/4k GPUs with 8B and
    70B models: the shared bandwidth in proportion to the GPUs (2 TB/s per 16k), the failure rate
    per GPU that of Llama 3's job, 4M tokens a step at 1k GPUs and 16M at 4k."""
    out = [Cluster("Llama-3-405B-like, 16k GPUs", 16_384, 405e9, step_time_s(405e9, 16.8e6 / 16_384),
                   LLAMA3_MTBF_S, 2e12)]
    for gpus, tokens in ((1024, 4.2e6), (4096, 16.8e6)):
        for params, label in ((8e9, "8B"), (70e9, "70B")):
            out.append(Cluster(f"{label}, {gpus // 1024}k GPUs", gpus, params, step_time_s(params, tokens / gpus),
                               PER_GPU_MTBF_S / gpus, 2e12 * gpus / 16_384))
    return out


SOURCES = (
    ("GPUs, model size", "the configuration (Llama 3 405B: 16,384 H100s, paper sec. 3.3)"),
    ("step time", "6 x params x tokens per GPU / 400 TFLOP/s (Llama 3: 38-43% bf16 MFU; 16M tokens a "
                  "step at 16k GPUs); 4M tokens at 1k GPUs, 16M at 4k: assumption"),
    ("failure rate", "Llama 3: 419 unexpected interruptions in 54 days = one per 3.09 h at 16k GPUs; "
                     "per GPU the same, so 1k GPUs: one per 49 h, 4k: one per 12 h"),
    ("shared bandwidth", "Llama 3: 2 TB/s sustained (7 TB/s peak) at 16k GPUs; in proportion to GPUs "
                         "elsewhere (assumption); reads as fast as writes (assumption)"),
    ("local disk", "10 GB/s per node of 8 GPUs (assumption: NVMe); used only with staging"),
    ("state bytes", "14 bytes/param: bf16 weights + fp32 master + fp32 Adam m, v (mixed-precision Adam)"),
    ("gradient bytes", "4 bytes/param (fp32 gradients reduce-scattered; assumption); TopK: ratio x "
                       "(4 value + 2 index-delta bytes), docs/format.md's u16 deltas"),
    ("snapshot", "rank state / 20 GB/s device-to-host (assumption: PCIe 5 x16, shared)"),
    ("replay", "a rank's differential read at its share of the read bandwidth + an optimizer step at "
               "2 TB/s HBM (3 x rank state bytes); the CPU replay rate is measured in the validation"),
    ("record cost", "1.6% of a step: docs/measurements.md, DDP TopK(0.01) on the quick GPT (2026-11-26), "
                    "or --stats"),
    ("batch commit", "50 ms per batch on a shared file system (assumption; 3-30 ms measured locally, "
                     "tune_measured.json), or --stats"),
    ("restart", "600 s from failure to resume (assumption: scheduler, container, NCCL init at scale)"),
    ("sharding", "FSDP: each rank holds and writes 1/GPUs of the state"),
)


def measured_from_stats(path: str) -> Measured:
    """The ratios of a saved ``opt.stats()`` or CONTROLLER.json (the controller's measured costs)."""
    with open(path) as f:
        data = json.load(f)
    costs = (data.get("controller") or {}).get("costs") or data.get("costs")
    if not isinstance(costs, dict) or not costs.get("step_s"):
        raise ValueError(f"{path}: no measured costs (expected controller.costs or costs with step_s)")
    return Measured(record_frac=float(costs.get("record_s", 0.0)) / float(costs["step_s"]),
                    batch_fixed_s=float(costs.get("batch_fixed_s", Measured.batch_fixed_s)))


# ------------------------------------------------------------------ validation against real kill runs
def predicted_goodput(costs: Costs, limits: Limits, full_every: int, batch_steps: int | None) -> float:
    """Steps kept per wall-clock second: the share of the time not wasted, over a step's time."""
    return (1.0 - evaluate(costs, limits, full_every, batch_steps).waste) / costs.step_s


def run_spread(e: Evaluation, rate: float, lives: int, dead_sd_s: float, replicas: int = 2000,
               seed: int = 0) -> tuple[float, float]:
    """The mean and standard deviation of the goodput a run of ``lives`` stratified lives
    (lifelog.stratified_lives, mean 1/rate) would measure if the model's session were exactly
    true: nothing kept for e.dead_s (its spread ``dead_sd_s``: the restarts' as the run measured
    them, normal, cut at 0), then chunks of e.chunk_steps steps, Gamma distributed with the model's
    mean and variance. Not a prediction (evaluate is that; this mean is its check): how far one
    run of a dozen lives lands from the expectation by where its kills happen to fall in the
    chunks, against which a row's error is judged."""
    import lifelog
    import numpy as np  # (only here: the rest of the model is pure Python)

    if lives / rate / e.chunk_s > 1e5:         # a run of that many chunks: no scatter worth simulating
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    n = e.chunk_steps
    scale = e.chunk_var_s2 / e.chunk_s if e.chunk_var_s2 > 0 else 0.0
    goodputs = []
    for _ in range(replicas):
        x = np.array(lifelog.stratified_lives(rng, 1.0 / rate, lives / rate))
        dead = np.maximum(e.dead_s + dead_sd_s * rng.standard_normal(len(x)), 0.0)
        shape = (len(x), int(np.max(x) / e.chunk_s * 2) + 10)
        chunks = rng.gamma(e.chunk_s / scale, scale, shape) if scale > 0 else np.full(shape, e.chunk_s)
        ends = np.cumsum(chunks, axis=1) + dead[:, None]
        # (the chunks' time kept over a step's mean, as evaluate counts it: its mean is the model's)
        goodputs.append(np.sum(chunks * (ends <= x[:, None])) / (e.chunk_s / n) / np.sum(x))
    return float(np.mean(goodputs)), float(np.std(goodputs))


def first_order_goodput(costs: Costs, limits: Limits, full_every: int, batch_steps: int | None) -> float:
    """What the model predicted before it was exact for Poisson failures: the lost share = rate x
    the cost of one failure, that cost being the exact model's in the limit of rare failures (the
    same code, no second formula), capped at 1."""
    rare = dataclasses.replace(limits, failure_rate_per_s=1e-12)
    e = evaluate(costs, limits, full_every, batch_steps)
    lost = min(1.0, limits.failure_rate_per_s * evaluate(costs, rare, full_every, batch_steps).per_failure_s)
    return (1.0 - e.overhead) * (1.0 - lost) / costs.step_s


VALIDATION_INPUTS = (
    ("failure rate", "lives / wall time, both from the run's timeline: every life ends in a SIGKILL, the "
                     "last at the end of the budget; the lives' lengths are exponential (stratified draws)"),
    ("step time", "the mean wall time between consecutive step ends within a life, over every life of the "
                  "run (the model's step with full checkpoints amortised): split into T, c and S/F by the costs "
                  "the trainers measured (CONTROLLER.json)"),
    ("step variance", "the variance of those step times, from the same timeline (a kill lands in a long step "
                      "more often than in a short one: the model charges the chunk in progress var / 2 E[C] more "
                      "than half a chunk)"),
    ("restart", "per life, from the driver starting the trainer to the end of its first step, less one "
                "steady step, resume's load and replay and the base checkpoint's stall (fork, imports, model "
                "build, wrap, the first step's warm-up), plus the reaping after each kill (timeline: kill to "
                "end): mean over every life, a life killed before its first step ended counted as a restart at "
                "least that long (Kaplan-Meier; a mean over the lives that finished a step misses the long "
                "restarts the kills cut short)"),
    ("load, replay", "resume's load time, mean over the lives that resumed (the first loads nothing); "
                     "replay: resume's replay time per record replayed in the run"),
    ("S, c, P, batch write", "CONTROLLER.json of the setting's directory (medians of the last 63 samples of "
                             "the run)"),
    ("goodput measured", "durable steps at the end (the manifest) / the timeline's wall time"),
)


def _in_force(row: dict, spent: dict | None) -> tuple[str, float]:
    """The settings the run trained with: a fixed setting's own; "auto"'s, the ones in force for
    most of its steps (and their share of the steps)."""
    if spent and spent.get("settings"):
        counts = spent["settings"]
        label = max(counts, key=lambda k: counts[k])
        return label, counts[label] / sum(counts.values())
    return row["last_in_force"], math.nan


def _from_the_run(in_run: Costs, spent: dict, full_every: int, batch_steps: int | None) -> Costs:
    """The model's inputs as the run spent them (VALIDATION_INPUTS): the timeline's step time,
    restart, load and replay per record; stall, recording, persist and batch writes measured by
    the trainers (CONTROLLER.json)."""
    record_s = in_run.record_s if batch_steps is not None else 0.0
    step_s = max(spent["step_s"] - record_s - in_run.stall_s / full_every, 1e-6)
    replay_s = spent["replay_s"] / spent["replayed"] if spent["replayed"] else in_run.replay_s
    # (A summary written before the timeline had kills and step variances: none charged.)
    restart_s = spent["before_minus_resume_s"] + spent.get("reap_s", 0.0) - in_run.stall_s
    return dataclasses.replace(in_run, step_s=step_s, record_s=record_s, restart_s=max(0.0, restart_s),
                               load_s=spent["load_s"], replay_s=replay_s, step_var_s2=spent.get("step_var_s2", 0.0))


def _previous_inputs(costs: Costs, spent: dict) -> Costs:
    """The inputs as the validation took them before the step variance and the censored restarts
    (deterministic steps; the restart's mean over the lives that finished a step, no reaping)."""
    if "before_minus_resume_finished_s" not in spent:
        return costs
    restart_s = spent["before_minus_resume_finished_s"] - costs.stall_s
    return dataclasses.replace(costs, step_var_s2=0.0, restart_s=max(0.0, restart_s))


def _spent(results_dir: str, row: dict) -> dict | None:
    """What the run spent: summarised afresh from the setting's timeline when it is in
    ``results_dir`` (lifelog's summary as it stands), else the summary the run saved in its CSV."""
    name = f"tune_real_round{row.get('round', '0')}-{row['settings'].replace('/', '_')}.timeline"
    path = os.path.join(results_dir, name)
    if os.path.exists(path):
        import lifelog

        return lifelog.summarize(lifelog.read(path))
    return json.loads(row["timeline"]) if row.get("timeline") else None


def validate(results_dir: str) -> list[dict]:
    """The model against experiments/tune_frequency.py's real run in ``results_dir``
    (tune_real.csv, and tune_measured.json when the measurement phase ran): each setting's goodput
    (durable steps per wall-clock second, under SIGKILLs) beside the model's prediction at the
    failure rate the run had, goodput = (1 - waste) / step time, from four sets of inputs:

    - "model": what the run itself spent (VALIDATION_INPUTS): the model then predicts only what
      the kills cost (the lost work, the replay, the sessions cut short), which is its content;
    - "first order": the same inputs through the model's first-order limit (rate x cost of a
      failure), what it computed before it was exact for Poisson failures;
    - "ctl costs": the costs as the trainers' controllers measured them (CONTROLLER.json: medians
      of the last 63 samples, restart from process start to resume), what the previous validation
      used (minus its probe-ratio recording charge, which counted the writers' share twice: a
      fixed setting's measured step interval already holds it);
    - "earlier": tune_measured.json's costs (tune_frequency.costs_of), measured minutes earlier
      under another load, when that file is there."""
    with open(os.path.join(results_dir, "tune_real.csv"), newline="") as f:
        real = list(csv.DictReader(f))
    earlier_costs = None
    measured_path = os.path.join(results_dir, "tune_measured.json")
    if os.path.exists(measured_path):
        import tune_frequency  # (torch and lowdiff: only for the earlier phase's costs)

        with open(measured_path) as f:
            saved = json.load(f)
        earlier_costs = (saved["measured"]["small/dense"], saved["restart_s"]["small"], tune_frequency.costs_of)
    rows = []
    for r in real:
        spent = _spent(results_dir, r)
        label, share = _in_force(r, spent)
        full, batch = label.split("/")
        full_every, batch_steps = int(full), (None if batch == "off" else int(batch))
        in_run = None
        if r.get("in_run_costs"):
            in_run = Costs(**json.loads(r["in_run_costs"]))
        restart_s = float(r["restart_s"])
        row = {"round": r.get("round", "0"), "settings": r["settings"], "in_force": label,
               "in_force_share": share, "lives": int(r["kills"]) + 1}
        model = first = ctl = earlier = previous = math.nan
        lambda_d = waste = spread_pct = math.nan
        if spent is not None and in_run is not None and not math.isnan(spent["step_s"]):
            costs = _from_the_run(in_run, spent, full_every, batch_steps)
            limits = Limits(failure_rate_per_s=spent["lives"] / spent["wall_s"])
            model = predicted_goodput(costs, limits, full_every, batch_steps)
            first = first_order_goodput(costs, limits, full_every, batch_steps)
            previous = predicted_goodput(_previous_inputs(costs, spent), limits, full_every, batch_steps)
            e = evaluate(costs, limits, full_every, batch_steps)
            waste = e.waste
            _, spread = run_spread(e, limits.failure_rate_per_s, spent["lives"], spent.get("before_sd_s", 0.0))
            spread_pct = 100 * spread / model
            rare = dataclasses.replace(limits, failure_rate_per_s=1e-12)
            lambda_d = limits.failure_rate_per_s * evaluate(costs, rare, full_every, batch_steps).per_failure_s
            got = int(r["durable_steps"]) / spent["wall_s"]
            row.update(wall_s=spent["wall_s"], step_s=spent["step_s"], before_s=spent["before_s"],
                       restart_s=costs.restart_s, short_lives=spent["short_lives"],
                       step_sd_s=math.sqrt(costs.step_var_s2), reap_s=spent.get("reap_s", math.nan),
                       in_progress_s=spent.get("in_progress_s", math.nan),
                       length_biased_s=(spent["step_s"] ** 2 + costs.step_var_s2) / (2 * spent["step_s"]))
        else:
            got = float(r["goodput_steps_per_s"])
            row.update(wall_s=float(r["wall_s"]), step_s=math.nan, before_s=math.nan, restart_s=restart_s,
                       short_lives=math.nan, step_sd_s=math.nan, reap_s=math.nan, in_progress_s=math.nan,
                       length_biased_s=math.nan)
        csv_limits = Limits(failure_rate_per_s=row["lives"] / float(r["wall_s"]))
        if in_run is not None:
            ctl_restart = restart_s if not math.isnan(restart_s) else in_run.restart_s
            ctl = predicted_goodput(dataclasses.replace(in_run, restart_s=ctl_restart), csv_limits, full_every,
                                    batch_steps)
        if earlier_costs is not None:
            measured, earlier_restart, costs_of = earlier_costs
            earlier = predicted_goodput(costs_of(measured, restart_s if not math.isnan(restart_s) else earlier_restart,
                                                 1.0), csv_limits, full_every, batch_steps)
        row.update(lambda_d=lambda_d, model_waste_pct=100 * waste, measured_goodput=got, predicted_goodput=model,
                   error_pct=_error(model, got), spread_pct=spread_pct, previous_model=previous,
                   error_previous_pct=_error(previous, got),
                   first_order=first, error_first_pct=_error(first, got), ctl_costs=ctl,
                   error_ctl_pct=_error(ctl, got), predicted_earlier_costs=earlier,
                   error_earlier_pct=_error(earlier, got))
        rows.append(row)
    return rows


def _error(predicted: float, got: float) -> float:
    return 100 * (predicted - got) / got if got > 0 and not math.isnan(predicted) else math.nan


def judged(row: dict) -> bool:
    """A row counts towards the target when it made durable progress and trained with one setting
    (an "auto" run that changed its settings for more than a tenth of its steps is shown, not judged)."""
    return row["measured_goodput"] > 0 and not (row["in_force_share"] < 0.9)


def print_validation(rows: list[dict]) -> None:
    print("\nvalidation: goodput (durable steps per second) of experiments/tune_frequency.py's real SIGKILL runs on "
          "this machine against the model; inputs and their sources:")
    for name, source in VALIDATION_INPUTS:
        print(f"  {name:<22}{source}")
    columns = [("model", "predicted_goodput", "error_pct"), ("previous", "previous_model", "error_previous_pct"),
               ("1st ord", "first_order", "error_first_pct"), ("ctl costs", "ctl_costs", "error_ctl_pct")]
    if any(not math.isnan(r["predicted_earlier_costs"]) for r in rows):
        columns.append(("earlier", "predicted_earlier_costs", "error_earlier_pct"))
    print(f"{'round':<6}{'setting':<11}{'in force':>13}{'lives':>6}{'wall s':>7}{'step s':>7}{'sd':>6}{'before s':>9}"
          f"{'reap':>6}{'in prog':>8}{'biased':>7}{'rate*D':>7}{'waste':>7}{'measured':>9}"
          + "".join(f"{name:>{max(8, len(name) + 1)}}{'error':>8}" + (f"{'run sd':>7}" if name == "model" else "")
                    for name, _, _ in columns))
    for r in rows:
        share = "" if math.isnan(r["in_force_share"]) or r["in_force_share"] >= 0.995 else \
            f" {100 * r['in_force_share']:.0f}%"
        mark = "" if judged(r) else " *"
        print(f"{r['round']!s:<6}{r['settings'] + mark:<11}{r['in_force'] + share:>13}{r['lives']:>6}"
              f"{r['wall_s']:>7.0f}{r['step_s']:>7.3f}{r['step_sd_s']:>6.3f}{r['before_s']:>9.2f}{r['reap_s']:>6.2f}"
              f"{r['in_progress_s']:>8.2f}{r['length_biased_s']:>7.2f}{r['lambda_d']:>7.2f}"
              f"{r['model_waste_pct']:>6.0f}%{r['measured_goodput']:>9.3f}"
              + "".join(f"{r[value]:>{max(8, len(name) + 1)}.3f}{r[error]:>+7.1f}%"
                        + (f"{r['spread_pct']:>6.1f}%" if name == "model" else "") for name, value, error in columns))
    counted = [r for r in rows if judged(r)]
    for key, what in (("error_pct", "the run's own inputs"),
                      ("error_previous_pct", "the same, as before the step variance and the censored restarts"),
                      ("error_first_pct", "same inputs, first order"),
                      ("error_ctl_pct", "the controllers' costs"), ("error_earlier_pct", "earlier costs")):
        known = [r for r in counted if not math.isnan(r[key])]
        if known:
            within = sum(abs(r[key]) <= 10 for r in known)
            mean_abs = sum(abs(r[key]) for r in known) / len(known)
            mean = sum(r[key] for r in known) / len(known)
            print(f"target (model within 10% of the measured goodput), {what}: {within} of {len(known)} settings "
                  f"(mean |error| {mean_abs:.1f}%, mean error {mean:+.1f}%)")
            if key == "error_pct":
                inside = sum(abs(r[key]) <= 2 * r["spread_pct"] for r in known)
                print(f"  within two run sd (where the kills fell in the chunks moves one run that much): "
                      f"{inside} of {len(known)}")
    print("(in force: \"auto\" is predicted at the settings it trained with for most of its steps (their share shown); "
          "* not judged: no durable step, or settings changed for over a tenth of the steps. step s, sd: mean and "
          "standard deviation of a step in the run; before s: start of a life to the end of its first step, less "
          "one step, over every life (Kaplan-Meier); reap: kill to the trainer reaped; in prog: measured, a life's "
          "last step end to its kill, beside biased: E[S^2] / 2 E[S], what the model charges for it (half a "
          "step without the variance); rate*D: the failure rate times the first-order cost of a failure (small: "
          "the first-order regime); waste: the model's share of the time lost; previous: the model with "
          "deterministic steps and the restart averaged over the lives that finished a step, no reaping (the "
          "validation before); run sd: the standard deviation of one run's goodput, of that many lives, if the "
          "model were exactly true (where the kills fall in the chunks, the restarts' spread: run_spread). "
          "Assumed: failures a Poisson process (the lives' lengths are exponential), exact; "
          "chunk lengths Gamma distributed with the steps' mean and variance (steps independent); a restart of "
          "fixed length (its mean); batches and full intervals counted from each session's base checkpoint, at "
          "their nominal lengths; the replay half an interval plus the persist)")


# ------------------------------------------------------------------ tables, sweeps, main
def table(cluster: Cluster, outcomes: list[Outcome]) -> None:
    rank_gb = cluster.rank_write_bytes / 1e9
    print(f"\n{cluster.name}: {cluster.params / 1e9:.0f}B params, state {cluster.state_bytes / 1e12:.2f} TB "
          f"({rank_gb:.3f} GB per GPU), step {cluster.step_s:.2f} s, job MTBF {cluster.job_mtbf_s / HOUR_S:.1f} h, "
          f"shared {cluster.shared_bytes_per_s / 1e12:.2f} TB/s ({cluster.shared_share / 1e6:.0f} MB/s per GPU), "
          f"restart {cluster.restart_s:.0f} s; dense differential "
          f"{cluster.params * cluster.grad_bytes_per_param / 1e9:.0f} GB a step")
    header = (f"{'strategy':<24}{'F/B':>10}{'effective':>10}{'fail/d':>7}{'lost h/d':>9}{'recov h/d':>10}"
              f"{'stall h/d':>10}{'TB/d':>8}{'fabric':>8}{'wait s':>8}")
    print(header)
    print("-" * len(header))
    for o in outcomes:
        fb = f"{o.full_every}/{o.batch_steps if o.batch_steps is not None else '-'}"
        print(f"{o.strategy:<24}{fb:>10}{100 * o.effective:>9.2f}%{o.failures_per_day:>7.2f}{o.lost_h:>9.2f}"
              f"{o.recovery_h:>10.2f}{o.stall_h:>10.2f}{o.traffic_tb:>8.0f}{100 * o.fabric_busy:>7.1f}%"
              f"{o.wait_s:>8.1f}")


def sweeps(base: Cluster, measured: Measured, points: int) -> list[dict]:
    """Effective training time of each strategy against the job's failure rate and against the
    shared bandwidth, around ``base``."""
    rows = []
    for k in range(points):
        mtbf_h = 0.25 * (200 ** (k / (points - 1)))          # 0.25 h .. 50 h
        bw = 0.1e12 * (200 ** (k / (points - 1)))            # 0.1 .. 20 TB/s
        for sweep, cluster, x, label in (
                ("failure rate", dataclasses.replace(base, job_mtbf_s=mtbf_h * HOUR_S), 1 / mtbf_h,
                 "failures per hour"),
                ("storage bandwidth", dataclasses.replace(base, shared_bytes_per_s=bw), bw / 1e12,
                 "shared write bandwidth (TB/s)")):
            for s in STRATEGIES:
                rows.append({"sweep": sweep, "series": s.name, "x": x,
                             "y": 100 * assess(cluster, measured, s).effective, "x_label": label,
                             "y_label": "effective training time (%)", "title": f"{base.name}: {sweep}"})
    return rows


def write_csv(path: str, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
                        help="directory for the CSVs and figures (default: experiments/results)")
    parser.add_argument("--stats", help="a saved opt.stats() or CONTROLLER.json: its measured record cost and "
                                        "batch commit replace the defaults")
    parser.add_argument("--record-frac", type=float, help="what recording adds to a step (fraction)")
    parser.add_argument("--batch-fixed-s", type=float, help="the fixed cost of one batch commit (s)")
    parser.add_argument("--restart-s", type=float, help="from a failure to resume (s)")
    parser.add_argument("--validate", metavar="DIR", help="compare with tune_frequency.py's real run saved in DIR")
    parser.add_argument("--sweep-points", type=int, default=17)
    args = parser.parse_args(argv)
    measured = measured_from_stats(args.stats) if args.stats else Measured()
    measured = dataclasses.replace(measured, **{k: v for k, v in (("record_frac", args.record_frac),
                                                                  ("batch_fixed_s", args.batch_fixed_s))
                                                if v is not None})
    os.makedirs(args.out, exist_ok=True)
    print("inputs and their sources:")
    for name, source in SOURCES:
        print(f"  {name:<18}{source}")
    print(f"  (in force: record {100 * measured.record_frac:.2f}% of a step, batch commit "
          f"{measured.batch_fixed_s * 1e3:.0f} ms, TopK ratio {measured.topk_ratio})")
    rows = []
    configs = clusters()
    if args.restart_s is not None:
        configs = [dataclasses.replace(c, restart_s=args.restart_s) for c in configs]
    for cluster in configs:
        outcomes = [assess(cluster, measured, s) for s in STRATEGIES]
        table(cluster, outcomes)
        rows += [{"cluster": cluster.name, **dataclasses.asdict(o)} for o in outcomes]
    print("\nF/B: full-checkpoint interval / differential batch (- none); effective: share of wall-clock time "
          "on steps that are kept; per day (/d): failures, work redone, recovery (restart + load + replay), "
          "stalls (checkpoint stalls and waits for the storage); TB/d written to shared storage; fabric: that over "
          "what the shared bandwidth carries in a day; wait: saturation wait per full checkpoint")
    write_csv(os.path.join(args.out, "scale_model.csv"), rows)
    import plotting  # experiments/plotting.py: the figures, drawn from the CSVs alone
    sweep_csv = os.path.join(args.out, "scale_sweep.csv")
    write_csv(sweep_csv, sweeps(configs[0], measured, args.sweep_points))
    print(plotting.try_draw(sweep_csv))
    if args.validate:
        checked = validate(args.validate)
        print_validation(checked)
        validation_csv = os.path.join(args.out, "scale_validation.csv")
        write_csv(validation_csv, checked)
        print(plotting.try_draw(validation_csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
