"""What ties a local tier and its shared tier into one run: the ``TIERS.json`` marker that tells
readers a directory has a shared tier (docs/format.md, "Storage tiers"), one run id on both tiers,
and one layout (single-process or partitioned) in each."""
from __future__ import annotations

import dataclasses
import os

import fastio
from lowdiff.distributed.partition import Partition, is_partitioned
from lowdiff.errors import CheckpointError
from lowdiff.format.container import TIERS_VERSION, TiersMarker, read_file, write_json_file
from lowdiff.store.directory import CheckpointStore
from lowdiff.store.inventory import is_dead_temp
from lowdiff.store.manifest import MANIFEST_NAME
from lowdiff.store.retention import Policy
from lowdiff.tiers.policy import Tiers

__all__ = ["TIERS_NAME", "TIERS_VERSION", "check_layouts", "complete_in", "join_runs", "read_marker", "read_tiers",
           "refuse_runs", "write_marker"]

TIERS_NAME = "TIERS.json"


def join_runs(local: CheckpointStore, shared: CheckpointStore) -> None:
    """Make both tiers one run: a tier without files takes the other's run (a replaced node's new,
    empty local directory continues the shared tier's run). Two different runs are refused."""
    local_files, shared_files = bool(local.manifest.files()), bool(shared.manifest.files())
    if not local_files:
        local.run = shared.run
    elif not shared_files:
        shared.run = local.run
    elif local.run != shared.run:
        refuse_runs(local, shared)


def refuse_runs(local: CheckpointStore, shared: CheckpointStore):
    raise CheckpointError(f"{shared.directory} holds run {shared.run}, {local.directory} run {local.run}: "
                          f"the shared tier belongs to another training run")


def check_layouts(partition: Partition | None, shared_root: str) -> None:
    """One tier never mixes the single-process and the partitioned layout."""
    single = os.path.exists(os.path.join(shared_root, MANIFEST_NAME))
    if partition is not None and single:
        raise CheckpointError(f"{shared_root} holds single-process checkpoints: a partitioned run (torch.distributed) "
                              f"cannot drain into it; name another shared_dir")
    if partition is None and is_partitioned(shared_root):
        raise CheckpointError(f"{shared_root} is partitioned (written under torch.distributed): a single-process "
                              f"run cannot drain into it; name another shared_dir")


def complete_in(partition: Partition, root: str):
    """``complete(fulls)`` of the same rank in the partitioned directory ``root`` (the shared tier):
    evaluated at each call, with the set's session as ``partition.join`` left it."""
    return lambda fulls: dataclasses.replace(partition, root=root).complete(fulls)


# ---------------------------------------------------------------------- TIERS.json
def write_marker(local_dir: str, tiers: Tiers, local_policy: Policy) -> None:
    """Record in the local directory where its shared tier is and each tier's policy (committed
    with fastio.Writer: temporary file, fdatasync, rename, directory fsync)."""
    marker = TiersMarker(tiers.shared_dir, local_policy.describe(), tiers.shared.describe(), tiers.max_lag_steps)
    write_json_file(os.path.join(local_dir, TIERS_NAME), marker.to_json(), priority=fastio.URGENT,
                    is_dead_temp=is_dead_temp, unless_same=True)


def read_tiers(local_dir: str) -> TiersMarker | None:
    """The ``TIERS.json`` of ``local_dir`` (None: the directory has no shared tier). Raises
    CorruptCheckpointError for a file that is not a tier marker of this version."""
    path = os.path.join(local_dir, TIERS_NAME)
    data = read_file(path)
    return None if data is None else TiersMarker.from_json(data, path)


def read_marker(local_dir: str) -> dict | None:
    """``read_tiers`` as the fields by name that the file holds (None: the directory has no shared
    tier)."""
    marker = read_tiers(local_dir)
    return None if marker is None else marker.fields()
