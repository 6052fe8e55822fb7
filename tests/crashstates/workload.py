"""The single-process workloads of the crash-state explorer (not a test module): a tiny trainer
(tests/integration/lowdiff_helpers.py: BatchNorm, Dropout, AdamW, a cosine schedule, a stateful
sampler, TopK) whose checkpointing stresses one part of the commit protocol each.

``python traced.py ROOT TRACE workload.py NAME ROOT``: train ``WORKLOADS[NAME].steps`` steps into
ROOT/ckpt (and ROOT/shared with tiers), flushed every step so that the trace marks durable steps
often. ``options(name, root)`` gives ``lowdiff.wrap``'s settings for a later session on a crash state.
"""
from __future__ import annotations

import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

import torch  # noqa: E402
from lowdiff_helpers import build, train_steps, wrap  # noqa: E402

import lowdiff  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Workload:
    """``steps`` traced; a later session on a crash state trains to ``steps + extra``."""
    name: str
    steps: int
    full_every: int
    batch_steps: int
    keep_full: int = 2
    tiers: bool = False
    extra: int = 4


WORKLOADS = {w.name: w for w in (
    # a full checkpoint (step 4) between the first one and batches
    Workload("full", steps=5, full_every=4, batch_steps=2),
    # batch commits only after the first full checkpoint
    Workload("batch", steps=6, full_every=100, batch_steps=2),
    # every full checkpoint lets retention delete the one before and its batches
    Workload("retention", steps=7, full_every=2, batch_steps=1, keep_full=1),
    # the drainer copying each committed file to the shared tier, which keeps one full checkpoint
    Workload("tier", steps=6, full_every=3, batch_steps=1, keep_full=1, tiers=True),
)}


def directories(root: str) -> tuple[str, str]:
    return os.path.join(root, "ckpt"), os.path.join(root, "shared")


def options(work: Workload, root: str) -> dict:
    opts: dict = {"full_every": work.full_every, "batch_steps": work.batch_steps,
                  "retention": lowdiff.KeepLast(work.keep_full)}
    if work.tiers:
        opts["tiers"] = lowdiff.Tiers(directories(root)[1], shared=lowdiff.KeepLast(work.keep_full))
    return opts


def run(work: Workload, root: str) -> None:
    torch.set_num_threads(1)
    model, opt, sched, sampler = build()
    opt = wrap(directories(root)[0], model, opt, sched, sampler, **options(work, root))
    train_steps(model, opt, sched, sampler, 0, work.steps, on_step=lambda step: opt.flush())
    opt.close()


if __name__ == "__main__":
    run(WORKLOADS[sys.argv[1]], sys.argv[2])
