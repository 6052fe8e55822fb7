"""Resume from storage tiers: plan a recovery in the local and in the shared tier, take the newest
state that verifies (the local tier when both reach the same step), and say which tier was used.
A missing, empty or damaged local tier (a replaced node) falls back to the shared one. Partitioned
tiers (training under torch.distributed) are planned and restored at any world size alike.
"""
from __future__ import annotations

import logging
import os

import torch.distributed as dist

from lowdiff.errors import CorruptCheckpointError, NoCheckpointError
from lowdiff.partition import is_partitioned
from lowdiff.tiers import read_marker

from .distributed import plan_sets, restore_partitioned
from .restore import Restored, execute, plan_recovery, restore, warn

log = logging.getLogger("lowdiff")
TIERS = ("local", "shared")


def shared_tier(directory: str, wrapper, shared_dir) -> str | None:
    """The shared tier of ``directory``: ``shared_dir`` if given, else the wrapped optimizer's,
    else the one its ``TIERS.json`` names (None: the directory has no shared tier)."""
    if shared_dir is not None:
        return os.path.abspath(os.fspath(shared_dir))
    tiers = getattr(getattr(wrapper, "config", None), "tiers", None)
    if tiers is not None:
        return tiers.shared_dir
    try:
        marker = read_marker(directory)
    except (CorruptCheckpointError, OSError) as exc:
        warn(f"lowdiff: {exc}; resuming from {directory} alone")
        return None
    return None if marker is None else marker["shared_dir"]


def restore_from_tiers(local: str, shared: str, *, check_full, stop_step: int | None,
                       **run) -> tuple[Restored | None, str, bool]:
    """(Restored or None for two empty tiers, "local" | "shared", whether this rank got its own
    per-rank state back). ``run``: apply_full, params_for, optimizer_for, workers
    (recovery.restore.execute). Partitioned tiers: see restore_partitioned_tiers."""
    if is_partitioned(local) or is_partitioned(shared):
        return restore_partitioned_tiers(local, shared, check_full=check_full, stop_step=stop_step, **run)
    directories = dict(zip(TIERS, (local, shared)))
    plans, errors = {}, {}
    for tier, directory in directories.items():
        try:
            plan = plan_recovery(directory, check_full=check_full, stop_step=stop_step)
        except (NoCheckpointError, CorruptCheckpointError, OSError) as exc:
            errors[tier] = exc
            continue
        if plan is not None:
            plans[tier] = plan
    if not plans:
        if errors:
            raise NoCheckpointError("no storage tier can be resumed: " + "; ".join(
                f"{tier} tier {directories[tier]}: {exc}" for tier, exc in errors.items()))
        return None, "local", True
    order = sorted(plans, key=lambda tier: (-plans[tier].reach_step, TIERS.index(tier)))
    best = order[0]
    if best == "shared":
        why = f"{errors['local']}" if "local" in errors else (
            "it is empty or missing" if "local" not in plans else
            f"it reaches step {plans['local'].reach_step}, the shared tier step {plans['shared'].reach_step}")
        warn(f"lowdiff: resuming from the shared tier {shared}: the local tier {local} is not used ({why})")
    restored = execute(plans[best], **run)
    if len(order) == 1:
        return _said(restored, best)
    other = order[1]
    if restored.step >= plans[other].reach_step:
        plans[other].close()
        return _said(restored, best)
    # Records of the chosen tier failed to verify: the other tier may reach further.
    warn(f"lowdiff: the {best} tier reached only step {restored.step}; trying the {other} tier "
         f"(its files reach step {plans[other].reach_step})")
    alternative = execute(plans[other], **run)
    if alternative.step > restored.step:
        return _said(alternative, other)
    again = restore(directories[best], check_full=check_full, stop_step=stop_step, **run)
    return _said(again, best)


# ---------------------------------------------------------------------- partitioned tiers
def tier_reach(root: str, stop_step: int | None) -> int:
    """The step the newest complete full set of the partitioned directory ``root`` reaches by its
    manifests (at or before ``stop_step``): the smallest over its shares' chains; -1 for none.
    Its records may still fail to verify (the restore then ends earlier).

    The manifests are the reconciled views restore plans with (recovery.distributed.plan): a rank
    whose MANIFEST.json is missing or damaged has its list rebuilt from its share files, so a tier
    is neither under-estimated (a better tier passed over) nor judged by shares restore ignores."""
    sets, _ = plan_sets(root, stop_step)
    if not sets:
        return -1
    reach = sets[0].reach
    return reach if stop_step is None else min(reach, stop_step)


def _agreed_reach(directories: dict, stop_step: int | None) -> dict:
    """{tier: reach} planned by rank 0 and sent to every rank, so that all choose alike."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    plan: list = [None]
    if world == 1 or dist.get_rank() == 0:
        plan[0] = {tier: tier_reach(directory, stop_step) for tier, directory in directories.items()}
    if world > 1:
        dist.broadcast_object_list(plan, src=0)
    return plan[0]


def restore_partitioned_tiers(local: str, shared: str, *, check_full, stop_step: int | None, apply_full, params_for,
                              optimizer_for, workers=None) -> tuple[Restored | None, str, bool]:
    """Partitioned tiers (docs/format.md, "Partitioned directories with tiers"), on every rank of
    the process group alike: restore the tier whose newest complete set reaches furthest (the
    local one when equal) with recovery.distributed; if it ends before the other tier's plan, try
    that one and keep the further."""
    directories = dict(zip(TIERS, (local, shared)))
    reach = _agreed_reach(directories, stop_step)
    order = sorted((t for t in TIERS if reach[t] >= 0), key=lambda t: (-reach[t], TIERS.index(t)))
    if not order:
        return None, "local", True

    def attempt(tier):
        try:
            return restore_partitioned(directories[tier], check_full=check_full, apply_full=apply_full,
                                       params_for=params_for, optimizer_for=optimizer_for, stop_step=stop_step,
                                       workers=workers)
        except NoCheckpointError as exc:   # the same on every rank (the ranks agree on what failed)
            warn(f"lowdiff: the {tier} tier {directories[tier]} cannot be resumed: {exc}")
            return None, True
    best = order[0]
    if best == "shared":
        why = "it has no complete full checkpoint" if reach["local"] < 0 else \
            f"it reaches step {reach['local']}, the shared tier step {reach['shared']}"
        warn(f"lowdiff: resuming from the shared tier {shared}: the local tier {local} is not used ({why})")
    restored, own = attempt(best)
    if len(order) == 1 or (restored is not None and restored.step >= reach[order[1]]):
        return _said(restored, best, own)
    other = order[1]
    warn(f"lowdiff: the {best} tier reached only step {restored.step if restored else -1}; trying the {other} "
         f"tier (its files reach step {reach[other]})")
    alternative, alternative_own = attempt(other)
    if alternative is not None and (restored is None or alternative.step > restored.step):
        return _said(alternative, other, alternative_own)
    if restored is None:
        return None, best, True
    restored, own = attempt(best)
    return _said(restored, best, own)


def _said(restored: Restored | None, tier: str, own: bool = True) -> tuple[Restored | None, str, bool]:
    if restored is not None:
        log.info("lowdiff: resumed step %d from the %s tier (%s)", restored.step, tier, restored.directory)
    return restored, tier, own
