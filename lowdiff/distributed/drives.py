"""lowdiff.distributed.drives: the ranks of a node spread over its local drives (docs/format.md, "Rank
directories on several local drives"): which local rank this process is, which drive its rank
directory goes to (local rank mod the number of drives, the checkpoint directory being drive 0), and
placing a new rank directory there, named by ``rank-NNNNN/DRIVE.json`` in the checkpoint directory.

Two collectives, once at wrap, on every rank alike: the ranks' hosts (and torchrun's LOCAL_RANK) are
gathered, and after each rank placed its directory, whether every rank could (a rank that fails must
not leave the others waiting in the next collective).
"""
from __future__ import annotations

import os
import socket

import fastio
from lowdiff.distributed.partition import Partition
from lowdiff.errors import CheckpointError, MissingDeviceError
from lowdiff.format.container import DriveRecord, write_json_file
from lowdiff.store.directory import make_durable_directory
from lowdiff.store.inventory import is_dead_temp
from lowdiff.store.rankdirs import DRIVE_NAME, drive_of, home_directory
from lowdiff.store.stripes import check_stripe_dirs


def _env_local() -> tuple[int, int] | None:
    """(LOCAL_RANK, LOCAL_WORLD_SIZE) as torchrun sets them (None: either is absent or not a number)."""
    try:
        local, count = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    return (local, count) if 0 <= local < count else None


def local_ranks(rank: int, world: int) -> tuple[int, int]:
    """(this rank's local rank, the number of ranks on its node). Collective when ``world`` > 1:
    torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE when every rank has them, else the rank's place among
    the ranks on its host (by host name)."""
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    host, env = socket.gethostname(), _env_local()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (host, env))
    if env is not None and all(other is not None for _, other in gathered):
        return env
    same_host = [r for r, (name, _) in enumerate(gathered) if name == host]
    return same_host.index(rank), len(same_host)


def _holds_files(home: str) -> bool:
    """Whether ``home`` exists and holds anything but temporary files (a rank directory in use)."""
    try:
        return any(not name.startswith(".") for name in os.listdir(home))
    except FileNotFoundError:
        return False


def place_rank_directory(root: str, rank: int, drives: tuple[str, ...], local_rank: int) -> str:
    """The directory rank ``rank`` of ``root`` writes: one that exists stays where it is (its
    DRIVE.json, or ``root/rank-NNNNN`` itself); a new one goes on drive ``local_rank mod
    len(drives)`` (``drives[0]`` is ``root``): there it is created, durably, and DRIVE.json is
    committed into a new ``root/rank-NNNNN``, before anything is written into it."""
    home = home_directory(root, rank)
    where = drive_of(home)   # (raises MissingDeviceError for a drive not mounted)
    if where is not None:
        return where
    number = local_rank % len(drives)
    if number == 0 or _holds_files(home):
        return home
    target = os.path.join(drives[number], os.path.basename(home))
    make_durable_directory(target)   # (the drive's directory too, at a run's first start, as root is)
    make_durable_directory(home)
    write_json_file(os.path.join(home, DRIVE_NAME), DriveRecord(target).to_json(), priority=fastio.URGENT,
                    is_dead_temp=is_dead_temp)
    return target


def spread_over_drives(partition: Partition, stripe_dirs: tuple[str, ...]) -> str:
    """Place this rank's directory of ``partition`` on its drive (``place_rank_directory``; the
    drives: the partition's root, then ``stripe_dirs``) on every rank at once; returns it. Raises
    on every rank when one could not place its own (the first such rank's error; on that rank, its
    own). A node with more drives than ranks: this rank's stripe directories on its other share
    drives go to ``partition.stripe_dirs`` (``share_stripe_dirs``)."""
    drives = (partition.root, *check_stripe_dirs(partition.root, stripe_dirs))
    local, count = local_ranks(partition.rank, partition.world)
    error: BaseException | None = None
    why = None
    where = ""
    try:
        where = place_rank_directory(partition.root, partition.rank, drives, local)
    except (CheckpointError, OSError) as exc:
        error, why = exc, (isinstance(exc, MissingDeviceError), f"rank {partition.rank}: {exc}")
    if partition.world > 1:
        import torch.distributed as dist

        said: list = [None] * partition.world
        dist.all_gather_object(said, why)
        why = next((w for w in said if w), None)
    if error is not None:
        raise error
    if why is not None:
        raise (MissingDeviceError if why[0] else CheckpointError)(why[1])
    partition.stripe_dirs = share_stripe_dirs(drives, local, count, where)
    return where


def share_stripe_dirs(drives: tuple[str, ...], local: int, count: int, where: str) -> tuple[str, ...]:
    """The stripe directories of local rank ``local`` of ``count`` whose rank directory is
    ``where``: ``rank-NNNNN`` on each of its share drives ``local + count``, ``local + 2 count``, ...
    below ``len(drives)`` (docs/format.md, "More drives than ranks"), less ``where`` itself (a rank
    directory an earlier run placed on one of them stays the rank directory)."""
    name = os.path.basename(os.path.normpath(where))
    others = (os.path.join(drives[k], name) for k in range(local + count, len(drives), count))
    return tuple(d for d in others if os.path.realpath(d) != os.path.realpath(where))
