"""The lives of experiments/tune_frequency.py's real SIGKILL runs: their lengths, and a timeline of
each life written as it happens, so the scale model's validation (experiments/scale_model.py
--validate) can take its inputs from the run itself.

A timeline is a text file, one event a line, ``time.monotonic()`` seconds (one clock for the
driver and its children on Linux):

    life  T                           the driver, just before it starts a trainer
    resumed T LOAD_S REPLAY_S N       the trainer, when recovery.resume returned (N records replayed)
    step  T F/B                       the trainer, at the end of each step (F/off: no differentials)
    kill  T                           the driver, just before it sends SIGKILL
    end   T                           the driver, once the trainer it SIGKILLed is reaped

Each line is one os.write of a few dozen bytes on a file opened O_APPEND (Linux appends each such
write whole, under the file's lock), so the driver's "kill" and a step's line never interleave,
and a trainer killed mid-step leaves whole lines behind. (Timelines written before "kill" existed
read as lives killed at their "end".)
"""
from __future__ import annotations

import dataclasses
import math
import os
import time

import numpy as np


def stratified_lives(rng: np.random.Generator, mtbf_s: float, budget_s: float) -> list[float]:
    """About ``budget_s / mtbf_s`` lives whose lengths are exponential with mean ``mtbf_s``, drawn
    stratified: life i is the exponential's quantile at (i + u) / n for one uniform u, in random
    order. Each life alone is exponential (what the model assumes of failures), and the n lives
    cover the distribution evenly, so a run of a few lives is not decided by where a handful of
    independent draws happen to fall (with 4-8 independent lives, the kills' positions in the
    full-checkpoint interval moved a run's goodput by tens of percent)."""
    n = max(1, round(budget_s / mtbf_s))
    quantiles = (np.arange(n) + rng.random()) / n
    return [float(x) for x in rng.permutation(-mtbf_s * np.log1p(-quantiles))]


def write(path: str, *fields: object) -> None:
    """Append one event (see the module docstring) to the timeline at ``path``."""
    line = " ".join([str(fields[0]), f"{time.monotonic():.6f}", *(str(f) for f in fields[1:])]) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


@dataclasses.dataclass
class Life:
    start: float
    end: float = math.nan
    kill: float = math.nan       # (no "kill" line: the life's end)
    load_s: float = 0.0          # nothing to load in a fresh directory's first life
    replay_s: float = 0.0
    replayed: int = 0
    resumed: bool = False
    steps: list[float] = dataclasses.field(default_factory=list)
    settings: list[str] = dataclasses.field(default_factory=list)


def read(path: str) -> list[Life]:
    """The lives in the timeline at ``path``; ValueError naming the file and line when it is not one."""
    lives: list[Life] = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            fields = line.split()
            try:
                kind, t = fields[0], float(fields[1])
                if kind == "life":
                    lives.append(Life(start=t))
                    continue
                life = lives[-1]
                if kind == "end":
                    life.end = t
                    if math.isnan(life.kill):
                        life.kill = t
                elif kind == "kill":
                    life.kill = t
                elif kind == "resumed":
                    life.resumed, life.load_s, life.replay_s, life.replayed = \
                        True, float(fields[2]), float(fields[3]), int(fields[4])
                elif kind == "step":
                    life.steps.append(t)
                    life.settings.append(fields[2])
                else:
                    raise ValueError(f"unknown event {kind!r}")
            except (IndexError, ValueError) as error:
                raise ValueError(f"{path}, line {number}: not a timeline event ({error}): {line.strip()!r}") from None
    return lives


def summarize(lives: list[Life]) -> dict:
    """What the run spent, measured, for the model's inputs:

    wall_s: the lives' total, from each trainer's start to its SIGKILL (the kill included);
    step_s: the mean wall time of a step in steady state: the time between consecutive step ends
      within a life, over every life (checkpoint stalls, recording and the writers' competition for
      the CPU included, as the model's step time with full checkpoints amortised, and as the load
      of the machine made it during the run, not during the last 63 steps);
    step_var_s2: the variance of those times (a kill lands in a long step more often than in a
      short one: the model charges the step in progress E[S^2] / 2 E[S], not E[S] / 2);
    in_progress_s: the mean time from a life's last step end to its kill (the step the kill cut
      short), to set beside the model's E[S^2] / 2 E[S];
    before_s: the mean time from a trainer's start to the end of its first step, less one steady
      step: restart (fork, imports, model build, wrap), load, replay, the base checkpoint and the
      first step's warm-up; over every life: a life killed before its first step ended counts as a
      restart at least that long (Kaplan-Meier: the kills, a Poisson process, cut long restarts
      more often than short ones, so a mean over the lives that finished a step is too short);
    before_sd_s: the standard deviation of that time over the lives that finished a step;
    reap_s: the mean time from a kill to the trainer reaped (the driver then starts the next one),
      the part of a restart the trainer's own events do not show;
    load_s: resume's load time, mean over the lives that resumed (a life killed before it is not
      a load of 0 s; the first life of a fresh directory loads nothing, as the model's first
      failure's restart would);
    replay_s / replayed: resume's replay time and the records it replayed, in total;
    settings: the settings in force at each step, counted."""
    if not lives or any(math.isnan(life.end) for life in lives):
        raise ValueError("a life without its end: the run was interrupted")
    gaps = np.concatenate([np.diff(life.steps) for life in lives] + [np.zeros(0)])
    step_s = float(np.mean(gaps)) if len(gaps) else math.nan
    started = [life for life in lives if life.steps]
    # Each life's time to its first step end, or (cut short) to its kill; less its own load and
    # replay for the restart alone.
    to_first = [(life.steps[0] if life.steps else life.kill) - life.start for life in lives]
    resume = [life.load_s + life.replay_s for life in lives]
    ended = [bool(life.steps) for life in lives]
    counts: dict[str, int] = {}
    for life in lives:
        for s in life.settings:
            counts[s] = counts.get(s, 0) + 1
    return {"lives": len(lives), "wall_s": sum(life.end - life.start for life in lives),
            "steps_run": sum(len(life.steps) for life in lives), "step_s": step_s,
            "step_var_s2": float(np.var(gaps)) if len(gaps) else math.nan,
            "in_progress_s": float(np.mean([life.kill - life.steps[-1] for life in started])) if started else math.nan,
            "before_s": censored_mean(to_first, ended) - step_s,
            "before_minus_resume_s": censored_mean([t - r for t, r in zip(to_first, resume)], ended) - step_s,
            # (as the validation took them before: over the lives that finished a step)
            "before_finished_s": float(np.mean([t for t, e in zip(to_first, ended) if e])) - step_s
            if started else math.nan,
            "before_sd_s": float(np.std([t for t, e in zip(to_first, ended) if e])) if started else math.nan,
            "before_minus_resume_finished_s": float(np.mean([t - r for t, r, e in zip(to_first, resume, ended) if e]))
            - step_s if started else math.nan,
            "reap_s": float(np.mean([life.end - life.kill for life in lives])),
            "load_s": float(np.mean([life.load_s for life in lives if life.resumed] or [0.0])),
            "replay_s": sum(life.replay_s for life in lives), "replayed": sum(life.replayed for life in lives),
            "short_lives": len(lives) - len(started), "settings": counts}


def censored_mean(times: list[float], observed: list[bool]) -> float:
    """The mean of a duration from observations some of which were cut short (``observed`` False:
    the duration is at least its time): the area under the Kaplan-Meier survival curve, the
    estimate that stays unbiased when what cuts durations short is independent of them. Beyond the
    longest time observed, nothing is known: the curve stops there."""
    order = sorted(zip(times, observed), key=lambda p: (p[0], not p[1]))
    survival, previous, area = 1.0, 0.0, 0.0
    for index, (t, seen) in enumerate(order):
        area += survival * (t - previous)
        previous = t
        if seen:
            survival *= 1.0 - 1.0 / (len(order) - index)
    return area if order else math.nan
