"""Resume from storage tiers: plan a recovery in the local and in the shared tier, take the newest
state that verifies (the local tier when both reach the same step), and say which tier was used.
A missing, empty or damaged local tier (a replaced node) falls back to the shared one.
"""
from __future__ import annotations

import logging
import os

from lowdiff.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from lowdiff.partition import is_partitioned
from lowdiff.tiers import read_marker

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
                       **run) -> tuple[Restored | None, str]:
    """(Restored or None for two empty tiers, "local" | "shared"). ``run``: apply_full,
    params_for, optimizer_for, workers (recovery.restore.execute)."""
    for directory in (local, shared):
        if is_partitioned(directory):
            raise CheckpointError(f"{directory} is partitioned: storage tiers are not supported with "
                                  f"torch.distributed yet")
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
        return None, "local"
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


def _said(restored: Restored | None, tier: str) -> tuple[Restored | None, str]:
    if restored is not None:
        log.info("lowdiff: resumed step %d from the %s tier (%s)", restored.step, tier, restored.directory)
    return restored, tier
