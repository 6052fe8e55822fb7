"""Resume from storage tiers: rank the local and the shared tier by the step their manifests reach,
restore the first (the local tier when both reach the same step), fall back to the other when it
ends earlier than that one's reach, and say which tier was used.
A missing, empty or damaged local tier (a replaced node) falls back to the shared one. Partitioned
tiers (training under torch.distributed) are planned and restored at any world size alike.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

import torch.distributed as dist

from lowdiff.distributed.partition import is_partitioned
from lowdiff.errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from lowdiff.store.inventory import take_inventory
from lowdiff.store.manifest import chain_end, describe_retained, plan_chain
from lowdiff.tiers.bucketranks import bucket_layout
from lowdiff.tiers.marker import read_marker
from lowdiff.tiers.objectstore import is_object_url
from recovery.execute import Restored
from recovery.partitioned.bucket import BucketShares, read_commits
from recovery.partitioned.plan import LOCAL, LocalFiles, plan_sets
from recovery.partitioned.restore import restore_partitioned
from recovery.pipeline.bucket import ObjectStoreError, open_bucket, unreachable, urls_named
from recovery.plan import checkpoint_directory, warn
from recovery.restore import restore

log = logging.getLogger("lowdiff")
TIERS = ("local", "shared")


@dataclasses.dataclass(frozen=True)
class TiersPlan:
    """Which tier recovery restores first and which it falls back to, decided from the steps their
    manifests reach before any live object changes (each tier's own plan, recovery.plan, is made
    when that tier is tried)."""

    directories: tuple          # ((tier, directory), ...) in TIERS order
    reach: tuple                # ((tier, step), ...) of the tiers whose manifests were read

    def directory(self, tier: str) -> str:
        return dict(self.directories)[tier]

    def reach_of(self, tier: str) -> int:
        return dict(self.reach).get(tier, -1)

    @property
    def order(self) -> tuple:
        """The tiers that reach a step, furthest first (the local one when equal)."""
        return tuple(sorted((t for t in TIERS if self.reach_of(t) >= 0),
                            key=lambda t: (-self.reach_of(t), TIERS.index(t))))


def plan_tiers(local: str, shared: str, stop_step: int | None, errors: dict) -> TiersPlan:
    """The plan of two plain tiers; a tier whose manifest cannot be read or does not retain
    ``stop_step`` is left out, its error put in ``errors``."""
    directories = tuple(zip(TIERS, (local, shared)))
    reach = []
    for tier, directory in directories:
        try:
            reach.append((tier, directory_reach(directory, stop_step)))
        except (NoCheckpointError, CorruptCheckpointError, OSError) as exc:
            errors[tier] = exc
    return TiersPlan(directories, tuple(reach))


def shared_tier(directory: str, wrapper, shared_dir) -> str | None:
    """The shared tier of ``directory``: ``shared_dir`` if given, else the wrapped optimizer's,
    else the one its ``TIERS.json`` names (None: the directory has no shared tier)."""
    if shared_dir is not None:
        return shared_dir if is_object_url(shared_dir) else os.path.abspath(os.fspath(shared_dir))
    tiers = getattr(getattr(wrapper, "config", None), "tiers", None)
    if tiers is not None:
        return tiers.shared_dir
    try:
        marker = read_marker(directory)
    except (CorruptCheckpointError, OSError) as exc:
        warn(f"lowdiff: {exc}; resuming from {directory} alone")
        return None
    return None if marker is None else marker["shared_dir"]


def object_store_of(wrapper):
    """The wrapped optimizer's ``Tiers(object_store=...)`` (None: the defaults)."""
    tiers = getattr(getattr(wrapper, "config", None), "tiers", None)
    return getattr(tiers, "object_store", None)


def restore_from_tiers(local: str, shared: str, *, check_full, stop_step: int | None, object_store=None,
                       **run) -> tuple[Restored | None, str, bool]:
    """(Restored or None for two empty tiers, "local" | "shared", whether this rank got its own
    per-rank state back). ``run``: apply_full, params_for, optimizer_for, workers, into
    (recovery.restore.restore). Partitioned tiers: see restore_partitioned_tiers.

    The tiers are ranked by the step their manifests reach (the local one when equal), and only
    the first is restored; so its full checkpoint can be read straight into the caller's tensors
    (``into``). If its records or full checkpoints fail to verify and it ends before the other
    tier's reach, the other is restored, and the further of the two kept."""
    if is_object_url(shared):
        return _restore_with_bucket(local, shared, check_full=check_full, stop_step=stop_step,
                                    object_store=object_store, **run)
    if is_partitioned(local) or is_partitioned(shared):
        return restore_partitioned_tiers(local, shared, check_full=check_full, stop_step=stop_step, **run)
    errors: dict = {}
    plan = plan_tiers(local, shared, stop_step, errors)
    directories = dict(plan.directories)

    def attempt(tier):
        try:
            return restore(directories[tier], check_full=check_full, stop_step=stop_step, **run), True
        except (NoCheckpointError, CorruptCheckpointError, OSError) as exc:
            errors[tier] = exc
            warn(f"lowdiff: the {tier} tier {directories[tier]} cannot be resumed: {exc}")
            return None, True
    restored, tier, own = _restore_furthest(plan, attempt, errors)
    if restored is None and errors:
        raise NoCheckpointError("no storage tier can be resumed: " + "; ".join(
            f"{tier} tier {directories[tier]}: {exc}" for tier, exc in errors.items()))
    return restored, tier, own


def _restore_with_bucket(local: str, url: str, *, check_full, stop_step: int | None, object_store,
                         **run) -> tuple[Restored | None, str, bool]:
    """``restore_from_tiers`` with the shared tier in an object store. The bucket's newest commit
    is read and ranked against the local tier by the step it reaches; when it is restored, its
    objects are fetched as the restore needs them (the full checkpoint, then the chain's batch
    files a few ahead of the replay, each checked against the size and CRC-32C the commit names:
    recovery.bucket). A bucket that cannot be read is skipped with a warning, as a damaged shared
    directory is."""
    if _rank0_says(lambda: is_partitioned(local) or _bucket_layout(url, object_store) == "partitioned"):
        return _restore_partitioned_bucket(local, url, check_full=check_full, stop_step=stop_step,
                                           object_store=object_store, **run)
    errors: dict = {}
    try:
        local_reach = directory_reach(local, stop_step)
    except (NoCheckpointError, CorruptCheckpointError, OSError) as exc:
        local_reach, errors["local"] = -1, exc
    with tempfile.TemporaryDirectory(prefix="lowdiff-s3-") as staging:
        try:
            source = open_bucket(url, staging, object_store)
            reach = manifest_reach(source.committed.manifest, stop_step) if source.committed else -1
        except (CheckpointError, OSError) as exc:
            warn(f"lowdiff: the shared tier {url} cannot be read: {exc}")
            return restore_from_tiers(local, staging, check_full=check_full, stop_step=stop_step, **run)
        with source:
            plan = TiersPlan((("local", local), ("shared", url)),
                             ((("local", local_reach),) if "local" not in errors else ()) + (("shared", reach),))

            def attempt(tier):
                try:
                    if tier == "local":
                        return restore(local, check_full=check_full, stop_step=stop_step, **run), True
                    return source.restore(check_full=check_full, stop_step=stop_step, **run), True
                except ObjectStoreError as exc:
                    if tier == "shared" and not exc.missing:
                        raise   # the bucket chosen cannot be reached now: not a reason to resume older
                    errors[tier] = exc
                    warn(f"lowdiff: the {tier} tier {plan.directory(tier)} cannot be resumed: {exc}")
                    return None, True
                except (NoCheckpointError, CorruptCheckpointError, OSError) as exc:
                    errors[tier] = exc
                    warn(f"lowdiff: the {tier} tier {plan.directory(tier)} cannot be resumed: {exc}")
                    return None, True
            restored, tier, own = _restore_furthest(plan, attempt, errors)
    if restored is None and errors:
        raise NoCheckpointError("no storage tier can be resumed: " + "; ".join(
            f"{tier} tier {plan.directory(tier)}: {exc}" for tier, exc in errors.items()))
    return restored, tier, own


def _bucket_layout(url: str, options) -> str | None:
    try:
        return bucket_layout(url, options)
    except (CheckpointError, OSError):
        return None   # (the single layout's path says why it cannot be read)


def _rank0_says(decide):
    """``decide()`` of rank 0, on every rank of the process group (all choose alike)."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    said: list = [None]
    if world == 1 or dist.get_rank() == 0:
        said[0] = decide()
    if world > 1:
        dist.broadcast_object_list(said, src=0)
    return said[0]


def _restore_partitioned_bucket(local: str, url: str, *, check_full, stop_step: int | None, object_store,
                                **run) -> tuple[Restored | None, str, bool]:
    """``restore_from_tiers`` of a partitioned run whose shared tier is a bucket, at any world
    size: rank 0 reads every rank prefix's newest commit and sends them to all; the two partitioned
    tiers are ranked and restored as directories are (``restore_partitioned_tiers``), the bucket's
    files fetched by each rank as it reads them (recovery.partitioned.bucket: its own shares
    first, the chain a few files ahead of the replay, each object checked). The ranks agree on
    whether the bucket could be read: a store that cannot be reached, at the start or during the
    restore, fails the resume on every rank; commits that cannot be read leave the bucket out,
    with a warning."""
    with tempfile.TemporaryDirectory(prefix="lowdiff-s3-") as staging, \
            urls_named({os.path.join(staging, "bucket"), _rank0_says(lambda: os.path.join(staging, "bucket"))}, url):
        root = os.path.join(staging, "bucket")
        os.makedirs(root)

        def commits():
            try:
                return read_commits(url, object_store), None
            except (CheckpointError, OSError) as exc:
                return {}, (unreachable(exc), str(exc))
        found, failed = _rank0_says(commits)
        if failed is not None and failed[0]:
            raise CheckpointError(f"the shared tier {url} cannot be read now: {failed[1]}")
        if failed is not None:
            warn(f"lowdiff: the shared tier {url} cannot be read: {failed[1]}")
        with BucketShares(url, root, found, object_store) as shares:
            restored, tier, own = restore_partitioned_tiers(local, root, check_full=check_full, stop_step=stop_step,
                                                            shared_files=shares, **run)
            failure = str(shares.failure) if shares.failure is not None else None
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        failures = [failure]
        if world > 1:
            failures = [None] * world
            dist.all_gather_object(failures, failure)
        if any(failures):   # (an older state resumed on would drop the bucket's newer commits)
            raise CheckpointError(f"the shared tier {url} cannot be read now: {next(f for f in failures if f)}")
    if restored is not None and tier == "shared":
        restored = dataclasses.replace(restored, directory=url)
    return restored, tier, own


def manifest_reach(manifest, stop_step: int | None) -> int:
    """The step the chain of ``manifest``'s newest full checkpoint (at or before ``stop_step``)
    reaches, capped at ``stop_step``; -1 when it has none."""
    if stop_step is not None and manifest.fulls and not manifest.retains(stop_step):
        return -1
    fulls = [f.step for f in manifest.fulls if stop_step is None or f.step <= stop_step]
    if not fulls:
        return -1
    reach = chain_end(manifest, max(fulls), plan_chain(manifest, max(fulls)))
    return reach if stop_step is None else min(reach, stop_step)


def directory_reach(directory: str, stop_step: int | None) -> int:
    """The step a plain checkpoint directory reaches by its manifest: the chain of its newest full
    checkpoint (at or before ``stop_step``), capped at ``stop_step``; -1 when it has none.
    NoCheckpointError when it does not retain ``stop_step``. Its files may still fail to verify
    (the restore then ends earlier)."""
    directory = checkpoint_directory(directory)
    if not os.path.isdir(directory):
        return -1
    manifest = take_inventory(directory, skip_other_versions=stop_step is not None).manifest
    if stop_step is not None and manifest.fulls and not manifest.retains(stop_step):
        raise NoCheckpointError(f"{directory}: step {stop_step} is not retained; {describe_retained(manifest)}")
    fulls = [f.step for f in manifest.fulls if stop_step is None or f.step <= stop_step]
    if not fulls:
        return -1
    reach = chain_end(manifest, max(fulls), plan_chain(manifest, max(fulls)))
    return reach if stop_step is None else min(reach, stop_step)


def _restore_furthest(plan: TiersPlan, attempt, errors: dict | None = None):
    """Restore the tier that reaches furthest by ``plan`` (the local one when equal) with
    ``attempt(tier) -> (Restored | None, own)``; if it ends before the other tier's reach, try
    that one and keep the further (restoring the first again if it was). Returns (Restored or
    None, tier, own)."""
    order = plan.order
    if not order:
        return None, "local", True
    best = order[0]
    if best == "shared":
        why = (f"{errors['local']}" if errors and "local" in errors else
               "it has no full checkpoint to resume from" if plan.reach_of("local") < 0 else
               f"it reaches step {plan.reach_of('local')}, the shared tier step {plan.reach_of('shared')}")
        warn(f"lowdiff: resuming from the shared tier {plan.directory('shared')}: the local tier "
             f"{plan.directory('local')} is not used ({why})")
    restored, own = attempt(best)
    if len(order) == 1 or (restored is not None and restored.step >= plan.reach_of(order[1])):
        return _said(restored, best, own)
    other = order[1]
    warn(f"lowdiff: the {best} tier reached only step {restored.step if restored else -1}; trying the {other} "
         f"tier (its files reach step {plan.reach_of(other)})")
    alternative, alternative_own = attempt(other)
    if alternative is not None and (restored is None or alternative.step > restored.step):
        return _said(alternative, other, alternative_own)
    if restored is None:
        return None, best, True
    restored, own = attempt(best)   # the other tier's restore overwrote the caller's objects
    return _said(restored, best, own)


# ---------------------------------------------------------------------- partitioned tiers
def tier_reach(root: str, stop_step: int | None, files: LocalFiles = LOCAL) -> int:
    """The step the newest complete full set of the partitioned directory ``root`` reaches by its
    manifests (at or before ``stop_step``): the smallest over its shares' chains; -1 for none.
    Its records may still fail to verify (the restore then ends earlier).

    The manifests are the reconciled views restore plans with (recovery.partitioned.restore.plan): a rank
    whose MANIFEST.json is missing or damaged has its list rebuilt from its share files, so a tier
    is neither under-estimated (a better tier passed over) nor judged by shares restore ignores."""
    sets, _ = plan_sets(root, stop_step, files)
    if not sets:
        return -1
    reach = sets[0].reach
    return reach if stop_step is None else min(reach, stop_step)


def _agreed_plan(directories: dict, stop_step: int | None, files: dict) -> TiersPlan:
    """The plan of partitioned tiers, made by rank 0 and sent to every rank, so that all choose
    alike (``files``: {tier: how its files are reached})."""
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    plan: list = [None]
    if world == 1 or dist.get_rank() == 0:
        plan[0] = TiersPlan(tuple(directories.items()),
                            tuple((tier, tier_reach(directory, stop_step, files[tier]))
                                  for tier, directory in directories.items()))
    if world > 1:
        dist.broadcast_object_list(plan, src=0)
    return plan[0]


def restore_partitioned_tiers(local: str, shared: str, *, check_full, stop_step: int | None, apply_full, params_for,
                              optimizer_for, workers=None, into=None,
                              shared_files: LocalFiles = LOCAL) -> tuple[Restored | None, str, bool]:
    """Partitioned tiers (docs/format.md, "Partitioned directories with tiers"), on every rank of
    the process group alike: restore the tier whose newest complete set reaches furthest (the
    local one when equal) with recovery.partitioned.restore; if it ends before the other tier's plan, try
    that one and keep the further. ``shared_files``: how the shared tier's files are reached (a
    bucket's: recovery.partitioned.bucket)."""
    directories = dict(zip(TIERS, (local, shared)))
    files = {"local": LOCAL, "shared": shared_files}
    plan = _agreed_plan(directories, stop_step, files)

    def attempt(tier):
        try:
            return restore_partitioned(directories[tier], check_full=check_full, apply_full=apply_full,
                                       params_for=params_for, optimizer_for=optimizer_for, stop_step=stop_step,
                                       workers=workers, into=into, files=files[tier])
        except NoCheckpointError as exc:   # the same on every rank (the ranks agree on what failed)
            warn(f"lowdiff: the {tier} tier {directories[tier]} cannot be resumed: {exc}")
            return None, True
    return _restore_furthest(plan, attempt)


def _said(restored: Restored | None, tier: str, own: bool = True) -> tuple[Restored | None, str, bool]:
    if restored is not None:
        log.info("lowdiff: resumed step %d from the %s tier (%s)", restored.step, tier, restored.directory)
    return restored, tier, own
