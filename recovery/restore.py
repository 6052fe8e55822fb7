"""Finding the newest state that verifies and rebuilding it: load a full checkpoint, replay the
differentials after it. Shared by ``resume`` (into live objects) and ``export`` (into fresh ones).

Order of work, so that bad input changes nothing: reconcile the manifest with the directory; pick
the newest full checkpoint at or before the target that verifies and is what its entry says; let
the caller check that it fits its objects; open every batch file of its chain (an open file
survives a live trainer's retention); only then load it into the caller's objects and replay.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from lowdiff.batchfile import BatchReader
from lowdiff.errors import CorruptCheckpointError, DirectoryBusyError, NoCheckpointError, VersionMismatchError
from lowdiff.fullckpt import load_full
from lowdiff.inventory import check_entry, take_inventory
from lowdiff.manifest import MANIFEST_NAME, describe_retained, plan_chain

from .replay import replay

log = logging.getLogger("lowdiff")
_ATTEMPTS = 5   # re-reads of the directory when a live trainer's retention moved a file away


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int              # completed steps of the restored state
    full_step: int         # the full checkpoint it was rebuilt from
    full_index: dict
    full_state: dict       # the full checkpoint's state tree
    last_record: object    # the record of ``step`` (None when step == full_step)


def warn(message: str) -> None:
    log.warning(message)


class _Moved(Exception):
    """A listed file vanished and the manifest changed meanwhile: start again from a fresh view."""


def checkpoint_directory(directory) -> str:
    """``directory`` as a path; a path that is a file is refused by name."""
    if not isinstance(directory, (str, bytes, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    directory = os.fspath(directory)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(f"{directory} is a file, not a checkpoint directory")
    return directory


def restore(directory: str, *, check_full, apply_full, params_for, optimizer_for,
            stop_step: int | None = None) -> Restored | None:
    """Rebuild the newest durable state (or the one at ``stop_step``).

    ``check_full(path, index, state)`` raises if the checkpoint does not fit the caller's objects
    (nothing has been changed yet); ``apply_full(index, state)`` loads it into them;
    ``params_for(index)``/``optimizer_for(index)`` give the parameter list and optimizer to replay
    with. Falls back to older full checkpoints when a newer one does not verify. Returns None for a
    directory with nothing in it; raises NoCheckpointError when nothing verifies or ``stop_step``
    is not retained.
    """
    directory = checkpoint_directory(directory)
    if not os.path.isdir(directory):
        return None
    for _ in range(_ATTEMPTS):
        try:
            return _restore_once(directory, check_full, apply_full, params_for, optimizer_for, stop_step)
        except _Moved:
            continue
    raise DirectoryBusyError(f"{directory}: checkpoint files kept disappearing while they were read "
                             f"(a live trainer's retention); try again")


def _restore_once(directory, check_full, apply_full, params_for, optimizer_for, stop_step):
    inventory = take_inventory(directory, skip_other_versions=stop_step is not None)
    for note in inventory.notes:
        warn(f"lowdiff: {note}")
    manifest = inventory.manifest
    if stop_step is not None and not manifest.retains(stop_step):
        raise NoCheckpointError(f"{directory}: step {stop_step} is not retained; {describe_retained(manifest)}")
    fulls = sorted(manifest.fulls, key=lambda f: f.step, reverse=True)
    if stop_step is not None:
        fulls = [f for f in fulls if f.step <= stop_step]
    problems = []
    for full in fulls:
        path = os.path.join(directory, full.file)
        try:
            index, state = load_full(path)
            check_entry(path, full, index, os.path.getsize(path), manifest.run)
        except FileNotFoundError:
            _raise_if_moved(directory, inventory)
            problems.append(f"{path} is missing")
            warn(f"lowdiff: full checkpoint {path} is missing; falling back to an older one")
            continue
        except VersionMismatchError as exc:
            if stop_step is None:
                raise
            problems.append(str(exc))
            warn(f"lowdiff: {exc}; skipped (an older state was asked for)")
            continue
        except (CorruptCheckpointError, OSError, EOFError) as exc:
            problems.append(str(exc))
            warn(f"lowdiff: full checkpoint {path} does not verify ({exc}); falling back to an older one")
            continue
        check_full(path, index, state)
        chain = _open_chain(directory, inventory, manifest, full.step, stop_step)
        try:
            apply_full(index, state)
            step, last = replay(chain, full.step, params_for(index), optimizer_for(index), stop_step=stop_step,
                                warn=warn)
        finally:
            for _, reader in chain:
                reader.close()
        if problems:
            warn(f"lowdiff: resumed from the older full checkpoint of step {full.step}")
        if stop_step is not None and step != stop_step:
            raise NoCheckpointError(f"{directory}: step {stop_step} cannot be rebuilt; the newest reachable is {step}")
        return Restored(step, full.step, index, state, last)
    if problems or manifest.batches:
        raise NoCheckpointError(f"{directory}: no full checkpoint verifies" +
                                (f" at or before step {stop_step}" if stop_step is not None else "") +
                                (": " + "; ".join(problems) if problems else ""))
    return None


def _open_chain(directory: str, inventory, manifest, base_step: int, stop_step: int | None) -> list:
    """[(entry, open BatchReader)] continuing ``base_step`` (up to ``stop_step``). The chain ends
    before a batch that is missing or is not what its entry says (with a warning); a batch whose
    index is damaged (a torn or truncated file) still gives the records that verify."""
    chain = []
    for entry in plan_chain(manifest, base_step):
        if stop_step is not None and entry.first > stop_step:
            break
        path = os.path.join(directory, entry.file)
        try:
            reader = BatchReader(path)
        except FileNotFoundError:
            _raise_if_moved(directory, inventory)
            warn(f"lowdiff: {path} is missing; the chain from step {base_step} ends at step {entry.first - 1}")
            break
        except VersionMismatchError as exc:
            if stop_step is None:
                _close_all(chain)
                raise
            warn(f"lowdiff: {exc}; the chain ends before it")
            break
        except (CorruptCheckpointError, OSError, EOFError) as exc:
            warn(f"lowdiff: {exc}; the chain from step {base_step} ends at step {entry.first - 1}")
            break
        if reader.index is not None:  # without one, replay checks each record's step and checksum
            try:
                check_entry(path, entry, reader.index, reader.size, manifest.run)
            except CorruptCheckpointError as exc:
                reader.close()
                warn(f"lowdiff: {exc}; the chain from step {base_step} ends at step {entry.first - 1}")
                break
        chain.append((entry, reader))
    return chain


def _close_all(chain: list) -> None:
    for _, reader in chain:
        reader.close()


def _raise_if_moved(directory: str, inventory) -> None:
    """A listed file is gone: if the manifest changed since the view was taken, a live trainer
    moved on (retention) and the caller starts again; otherwise the file is really missing."""
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
            now = f.read()
    except FileNotFoundError:
        now = None
    if now != inventory.committed:
        raise _Moved()
