"""What a recovery will do, as data: the frozen plan every layout (single directory, partitioned
directory, storage tiers) produces before any live object changes, and what one candidate loaded.

A plan names the places recovery may start from, newest first (the order it falls back in when a
file fails to verify), the chain each continues by the manifests, and the target step, already
checked against the manifests: a target they say cannot be reached is refused while planning.
``recovery.execute`` carries a plan out; the layouts (recovery.restore, recovery.partitioned.restore)
know how to read their files.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

log = logging.getLogger("lowdiff")


def warn(message: str) -> None:
    log.warning(message)


def checkpoint_directory(directory) -> str:
    """``directory`` as a path; a path that is a file is refused by name."""
    if not isinstance(directory, (str, bytes, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory} is a file, not a checkpoint directory")
    return directory


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One place a recovery may start from: a full checkpoint (``source``: its manifest entry, or a
    partitioned directory's ``FullSet``) at ``step`` and the differentials continuing it, which
    reach ``reach`` by the manifests (the files may still end earlier)."""

    step: int
    source: Any
    reach: int


@dataclasses.dataclass(frozen=True)
class Plan:
    """A layout's decision, final before any live object changes (see the module doc).

    ``candidates`` are tried in order; ``opened`` holds the files the first one needs, already
    opened and checked against the manifest while planning (an open file survives a live
    trainer's retention); ``skipped`` the (file, why) of newer candidates that planning found do
    not verify; ``newest_step`` the newest step the directory's files reach (what resuming earlier
    abandons)."""

    layout: str                        # "directory" | "partitioned"
    directory: str
    target: int | None                 # the step asked for, None for the newest
    candidates: tuple[Candidate, ...]
    newest_step: int
    skipped: tuple = ()
    opened: tuple = ()
    view: Any = None                   # what the layout planned from (a directory's Inventory)

    def close(self) -> None:
        for _, reader in self.opened:
            reader.close()


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A candidate's full state, read and verified (into the caller's tensors where they fit)."""

    index: Any                         # its FullIndex
    state: Any                         # its FullState, as this process applies it
    file: str                          # the full checkpoint's file name (a set's first share)
    chain: tuple = ()                  # the layout's handle on the differentials to replay
    own: bool = True                   # whether this rank got its own per-rank state back
    replay: Any = None                 # a replay already decoding the chain's first records (or None)
