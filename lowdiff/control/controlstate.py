"""CONTROLLER.json: the controller's measurements kept beside the manifest, so that a restarted run
starts from what earlier sessions measured (byte layout: docs/format.md, "Controller measurements").

Advice, not state: nothing needed to resume is in it. Reading never raises for a bad file (the
caller is told what is wrong and starts from its initial guesses); writing uses fastio.Writer
(temporary file, fdatasync, rename, directory fsync), so a crash leaves the old file or the new one.
"""
from __future__ import annotations

import os

from lowdiff.format.container import CONTROLLER_VERSION, ControllerState, read_file, write_json_file
from lowdiff.store.inventory import is_dead_temp

__all__ = ["CONTROLLER_NAME", "CONTROLLER_VERSION", "UnusableState", "read_state", "write_state"]

CONTROLLER_NAME = "CONTROLLER.json"


class UnusableState(ValueError):
    """CONTROLLER.json exists but cannot be used; the message names the file and says why."""


def read_state(directory: str) -> tuple[dict[str, list[float]], dict] | None:
    """(samples by name, settings) from ``directory``'s CONTROLLER.json; None when there is none.
    Raises UnusableState for an unreadable file, another version or another shape."""
    path = os.path.join(directory, CONTROLLER_NAME)
    try:
        data = read_file(path)
    except OSError as exc:
        raise UnusableState(f"{path}: cannot be read as JSON ({exc})") from None
    if data is None:
        return None
    try:
        state = ControllerState.from_json(data, path)
    except ValueError as exc:
        raise UnusableState(str(exc)) from None
    return state.samples, state.settings()


def write_state(directory: str, samples: dict[str, list[float]], settings: dict) -> None:
    """Replace ``directory``'s CONTROLLER.json atomically (removing temporaries of dead writers)."""
    write_json_file(os.path.join(directory, CONTROLLER_NAME), ControllerState.of(samples, settings).to_json(),
                    is_dead_temp=is_dead_temp, fault="controller-write")
