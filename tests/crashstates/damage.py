"""Damage campaigns (issue #33, coverage): swapped files, flipped bits and truncations on a TopK
directory and on the shares of a partitioned directory. Not a test module.

A case damages one copy of a clean directory and checks what a user would see: ``verify`` must
report the damage (exit status 1, the file named) — "detected" — and a resume must either raise a
CheckpointError naming a file or land on a state that is byte for byte the uninterrupted run's at
the step it returns — never another state ("wrong"). A damaged file that resume does not need may
be passed over; one that it needs makes it fall back, and the fallback is checked the same way.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

import lowdiff  # noqa: E402
from lowdiff.cli import main as cli  # noqa: E402

MODES = ("swap", "flip", "truncate")


@dataclasses.dataclass(frozen=True)
class Case:
    where: str
    detected: bool
    outcome: str        # "exact", "refused" (a clear CheckpointError) or "wrong"
    harmless: bool = False   # not detected, and resume is exact at the clean directory's step: the
                             # bits changed were not data (alignment padding)
    detail: str = ""


def checkpoint_files(directory: str) -> list:
    """Paths of the full checkpoints, batches and shares under ``directory`` (rank directories too)."""
    out = []
    for top, _dirs, names in os.walk(directory):
        out += [os.path.join(top, n) for n in names if n.startswith(("full-", "diff-"))]
    return sorted(out)


def damage(directory: str, mode: str, rng) -> str:
    """Damage one file (or swap two) of ``directory``; what was done."""
    files = checkpoint_files(directory)
    if mode == "swap":
        # Two files of one kind exchange their bytes (a copy tool that mixed them up); in a
        # partitioned directory possibly across ranks.
        kind = "full-" if rng.random() < 0.5 else "diff-"
        same = [f for f in files if os.path.basename(f).startswith(kind)]
        if len(same) < 2:
            same = files
        a, b = (same[i] for i in rng.choice(len(same), size=2, replace=False))
        data_a, data_b = _read(a), _read(b)
        if data_a == data_b:
            return damage(directory, "flip", rng)
        _write(a, data_b)
        _write(b, data_a)
        return f"swapped {os.path.relpath(a, directory)} and {os.path.relpath(b, directory)}"
    path = files[int(rng.integers(len(files)))]
    size = os.path.getsize(path)
    if mode == "flip":
        offset, bit = int(rng.integers(size)), int(rng.integers(8))
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))
        return f"bit {bit} of byte {offset} of {os.path.relpath(path, directory)} flipped"
    offset = int(rng.integers(size))
    os.truncate(path, offset)
    return f"{os.path.relpath(path, directory)} truncated to {offset} of {size} bytes"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def verify(directory: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = cli.main(["verify", directory])
    return status, out.getvalue()


def run_case(clean: str, work: str, mode: str, rng, resume, clean_step: int) -> Case:
    """Damage a copy of ``clean`` in ``work`` and check it; ``resume(directory) -> (step, same
    as the uninterrupted run)``; ``clean_step``: where the undamaged directory resumes."""
    if os.path.exists(work):
        shutil.rmtree(work)
    shutil.copytree(clean, work)
    what = damage(work, mode, rng)
    status, report = verify(work)
    names = [os.path.basename(p) for p in what.split() if p.startswith(("full-", "diff-", "rank-"))]
    detected = status == 1 and all(os.path.basename(n) in report for n in names)
    log = logging.getLogger("lowdiff")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        step, exact = resume(work)
    except lowdiff.CheckpointError as exc:
        return Case(what, detected, "refused", detail=str(exc))
    finally:
        log.setLevel(level)
    return Case(what, detected, "exact" if exact else "wrong", detail=f"resumed at {step}",
                harmless=not detected and exact and step == clean_step and status == 0)
