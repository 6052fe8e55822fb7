"""CONTROLLER.json: the controller's measurements kept beside the manifest, so that a restarted run
starts from what earlier sessions measured (byte layout: docs/format.md, "Controller measurements").

Advice, not state: nothing needed to resume is in it. Reading never raises for a bad file (the
caller is told what is wrong and starts from its initial guesses); writing uses fastio.Writer
(temporary file, fdatasync, rename, directory fsync), so a crash leaves the old file or the new one.
"""
from __future__ import annotations

import json
import math
import os

import fastio
from lowdiff.store.inventory import is_dead_temp

CONTROLLER_NAME = "CONTROLLER.json"
CONTROLLER_VERSION = 1


class UnusableState(ValueError):
    """CONTROLLER.json exists but cannot be used; the message names the file and says why."""


def read_state(directory: str) -> tuple[dict[str, list[float]], dict] | None:
    """(samples by name, settings) from ``directory``'s CONTROLLER.json; None when there is none.
    Raises UnusableState for an unreadable file, another version or another shape."""
    path = os.path.join(directory, CONTROLLER_NAME)
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise UnusableState(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("version") != CONTROLLER_VERSION:
        version = body.get("version") if isinstance(body, dict) else None
        raise UnusableState(f"{path}: version {version!r}, this lowdiff reads version {CONTROLLER_VERSION}")
    samples, settings = body.get("samples"), body.get("settings")
    if not isinstance(samples, dict) or not isinstance(settings, dict):
        raise UnusableState(f"{path}: has no 'samples' and 'settings' objects")
    clean: dict[str, list[float]] = {}
    for name, values in samples.items():
        if not isinstance(values, list) or not all(_is_sample(v) for v in values):
            raise UnusableState(f"{path}: samples[{name!r}] is not a list of numbers >= 0")
        clean[name] = [float(v) for v in values]
    return clean, settings


def write_state(directory: str, samples: dict[str, list[float]], settings: dict) -> None:
    """Replace ``directory``'s CONTROLLER.json atomically (removing temporaries of dead writers)."""
    body = {"version": CONTROLLER_VERSION, "samples": samples, "settings": settings}
    data = json.dumps(body, indent=1, sort_keys=True).encode()
    for name in os.listdir(directory):   # a writer killed mid-write left its temporary file
        if name.startswith(f".{CONTROLLER_NAME}.tmp-") and is_dead_temp(name):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass
    with fastio.Writer(os.path.join(directory, CONTROLLER_NAME)) as writer:
        writer.write(data)


def _is_sample(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
