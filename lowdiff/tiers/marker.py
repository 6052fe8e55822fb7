"""What ties a local tier and its shared tier into one run: the ``TIERS.json`` marker that tells
readers a directory has a shared tier (docs/format.md, "Storage tiers"), one run id on both tiers,
and one layout (single-process or partitioned) in each."""
from __future__ import annotations

import dataclasses
import json
import os

import fastio
from lowdiff.distributed.partition import Partition, is_partitioned
from lowdiff.errors import CheckpointError, CorruptCheckpointError
from lowdiff.store.directory import CheckpointStore
from lowdiff.store.inventory import is_dead_temp
from lowdiff.store.manifest import MANIFEST_NAME
from lowdiff.store.retention import Policy
from lowdiff.tiers.policy import Tiers

TIERS_NAME = "TIERS.json"
TIERS_VERSION = 1


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
    body = {"version": TIERS_VERSION, "shared_dir": tiers.shared_dir, "local_policy": local_policy.describe(),
            "shared_policy": tiers.shared.describe(), "max_lag_steps": tiers.max_lag_steps}
    data = json.dumps(body, indent=1, sort_keys=True).encode()
    path = os.path.join(local_dir, TIERS_NAME)
    for name in os.listdir(local_dir):   # a writer killed mid-write left its temporary file
        if name.startswith(f".{TIERS_NAME}.tmp-") and is_dead_temp(name):
            try:
                os.unlink(os.path.join(local_dir, name))
            except FileNotFoundError:
                pass
    try:
        with open(path, "rb") as f:
            if f.read() == data:
                return
    except FileNotFoundError:
        pass
    with fastio.Writer(path, priority=fastio.URGENT) as writer:
        writer.write(data)


def read_marker(local_dir: str) -> dict | None:
    """The ``TIERS.json`` of ``local_dir`` (None: the directory has no shared tier)."""
    path = os.path.join(local_dir, TIERS_NAME)
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise CorruptCheckpointError(path, f"is not valid JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("version") != TIERS_VERSION or \
            not isinstance(body.get("shared_dir"), str):
        raise CorruptCheckpointError(path, f"is not a version {TIERS_VERSION} tier marker")
    return body

