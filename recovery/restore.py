"""Finding the newest state that verifies and rebuilding it: load a full checkpoint, replay the
differentials after it. Shared by ``resume`` (into live objects) and ``export`` (into fresh ones)."""
from __future__ import annotations

import dataclasses
import logging
import os

from lowdiff.errors import CorruptCheckpointError, NoCheckpointError
from lowdiff.fullckpt import load_full
from lowdiff.manifest import load_manifest, plan_chain

from .replay import replay

log = logging.getLogger("lowdiff")


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int              # completed steps of the restored state
    full_step: int         # the full checkpoint it was rebuilt from
    full_index: dict
    full_state: dict       # the full checkpoint's state tree
    last_record: object    # the record of ``step`` (None when step == full_step)


def warn(message: str) -> None:
    log.warning(message)


def restore(directory: str, *, params_for, optimizer_for, apply_full, stop_step: int | None = None) -> Restored | None:
    """Rebuild the newest durable state (or the one at ``stop_step``).

    ``apply_full(index, state)`` loads a full checkpoint into the caller's objects;
    ``params_for(index)``/``optimizer_for(index)`` give the parameter list and optimizer to replay
    with. Falls back to older full checkpoints when a newer one does not verify. Returns None for a
    directory with nothing in it; raises NoCheckpointError when nothing verifies.
    """
    if not os.path.isdir(directory):
        return None
    manifest = load_manifest(directory, warn=warn)
    fulls = sorted(manifest.fulls, key=lambda f: f.step, reverse=True)
    if stop_step is not None:
        fulls = [f for f in fulls if f.step <= stop_step]
    problems = []
    for full in fulls:
        path = os.path.join(directory, full.file)
        try:
            index, state = load_full(path)
        except (CorruptCheckpointError, OSError, EOFError) as exc:
            problems.append(str(exc))
            warn(f"lowdiff: full checkpoint {path} does not verify ({exc}); falling back to an older one")
            continue
        if index["step"] != full.step:
            problems.append(f"{path}: holds step {index['step']}, the manifest says {full.step}")
            continue
        apply_full(index, state)
        step, last = replay(directory, plan_chain(manifest, full.step), full.step, params_for(index),
                            optimizer_for(index), stop_step=stop_step, warn=warn)
        if problems:
            warn(f"lowdiff: resumed from the older full checkpoint of step {full.step}")
        if stop_step is not None and step != stop_step:
            raise NoCheckpointError(f"{directory}: step {stop_step} cannot be rebuilt; the newest reachable is {step}")
        return Restored(step, full.step, index, state, last)
    if problems or manifest.batches:
        raise NoCheckpointError(f"{directory}: no full checkpoint verifies" +
                                (": " + "; ".join(problems) if problems else "") +
                                (f" at or before step {stop_step}" if stop_step is not None else ""))
    return None
