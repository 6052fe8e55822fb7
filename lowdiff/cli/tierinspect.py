"""What ``python -m lowdiff inspect`` says about storage tiers: where the shared tier is, each
tier's retention policy and which tier a resume would start from."""
from __future__ import annotations

from lowdiff.distributed.partition import is_partitioned
from lowdiff.errors import CheckpointError
from lowdiff.store.inventory import take_inventory
from lowdiff.tiers.marker import read_marker


def shared_dir_of(directory: str, warn) -> str | None:
    """The shared tier named by ``directory``'s TIERS.json (None: none, or unreadable)."""
    try:
        marker = read_marker(directory)
    except (CheckpointError, OSError) as exc:
        warn(str(exc))
        return None
    return None if marker is None else marker["shared_dir"]


def describe_policies(directory: str) -> str:
    try:
        marker = read_marker(directory)
    except (CheckpointError, OSError):
        marker = None
    if marker is None:
        return "policies unknown: the local directory has no TIERS.json"
    return (f"local: {marker.get('local_policy', '?')}; shared: {marker.get('shared_policy', '?')}; "
            f"max lag {marker.get('max_lag_steps', '?')} steps")


def resume_choice(local: str, shared: str) -> str:
    """Which tier resume would take, by the steps each manifest reaches (resume also verifies
    every byte and may fall back)."""
    reach = {}
    for tier, directory in (("local", local), ("shared", shared)):
        try:
            if is_partitioned(local) or is_partitioned(shared):
                from recovery.tiers import tier_reach  # (lowdiff imports recovery only when asked)
                reach[tier] = tier_reach(directory, None)
            else:
                reach[tier] = take_inventory(directory, skip_other_versions=True).manifest.durable_step()
        except (CheckpointError, OSError):
            reach[tier] = -1
    tier = "local" if reach["local"] >= reach["shared"] else "shared"
    if reach[tier] < 0:
        return "resume        nothing to resume in either tier"
    return (f"resume        from the {tier} tier, step {reach[tier]} (local reaches {max(reach['local'], 0)}, "
            f"shared {max(reach['shared'], 0)})")
