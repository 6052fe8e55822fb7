"""Freed memory kept for reuse while a replay runs optimizer steps (glibc's malloc only).

An optimizer step on the CPU makes temporaries the size of each parameter and frees them (torch's
AdamW: two per parameter per step). glibc serves a request above its mmap threshold (128 KiB,
raised to at most 32 MiB as such blocks are freed) with a new mapping and unmaps it on free, and
trims the top of its heap once more than twice that is free there; so a replay step faults its
temporaries in again, page by page, every time. Measured (GPT-2 124M, AdamW, 2 cores): a step takes
245-390 ms with 75,000-185,000 minor faults, depending on where the dynamic thresholds happen to
stand in that process; with every size served from the heap and nothing trimmed, 140-190 ms with
none. That is why the replay's steps ran 2-2.5x slower inside a resume than in another process
doing the very same steps.

``keep_freed_memory()`` sets that while it is entered (M_MMAP_MAX 0, M_TRIM_THRESHOLD 2 GiB): each
step reuses the pages the previous step freed. On leaving, mappings are allowed again and the
thresholds are set where glibc's own adjustment takes them once blocks of 32 MiB have been freed
(mmap 32 MiB, trim 64 MiB) -- setting any of them stops that adjustment, so the previous state
cannot be handed back as it was -- and ``malloc_trim`` returns the heap's free pages to the system.
Numbers are unaffected: only where memory comes from changes.

Left alone (a no-op): another C library than glibc; malloc's settings chosen by the user
(GLIBC_TUNABLES naming glibc.malloc, or MALLOC_*_ variables); LOWDIFF_MALLOC_TUNING=0.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4   # malloc.h
_KEEP_TRIM = 2 ** 31 - 1          # the most mallopt takes (an int): in effect, never trim
_AFTER_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its
_AFTER_TRIM_THRESHOLD = 64 << 20  # adjustment ends for programs that free large blocks (trim: 2x)
_DEFAULT_MMAP_MAX = 65536         # glibc's DEFAULT_MMAP_MAX

# Variables through which a user tunes glibc's malloc: their choice stands.
_USER_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_lock = threading.Lock()
_depth = 0            # nested or concurrent replays: the first to enter sets, the last to leave restores
_applied = False
_libc: list = []


def _glibc():
    """glibc's mallopt and malloc_trim through ctypes, or None on another C library."""
    if not _libc:
        functions = None
        try:
            libc = ctypes.CDLL(None)
            if not hasattr(libc, "gnu_get_libc_version"):   # only glibc has it: musl's mallopt is a stub
                raise AttributeError("not glibc")
            mallopt, trim = libc.mallopt, libc.malloc_trim
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
            functions = (mallopt, trim)
        except (OSError, AttributeError):
            pass
        _libc.append(functions)
    return _libc[0]


def tuning_allowed() -> bool:
    """False when this process should keep malloc as it is (see the module's docstring)."""
    if os.environ.get("LOWDIFF_MALLOC_TUNING", "1").strip().lower() in ("0", "off", "no", "false"):
        return False
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", "") or any(v in os.environ for v in _USER_SETTINGS):
        return False
    return _glibc() is not None


def active() -> bool:
    """Whether freed memory is being kept for reuse right now."""
    return _applied


def _set(option: int, value: int) -> None:
    _glibc()[0](option, value)


@contextlib.contextmanager
def keep_freed_memory():
    """While entered, glibc's malloc serves every size from its heap and keeps what is freed."""
    global _depth, _applied
    with _lock:
        _depth += 1
        if _depth == 1 and tuning_allowed():
            _set(_M_TRIM_THRESHOLD, _KEEP_TRIM)
            _set(_M_MMAP_MAX, 0)
            _applied = True
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _applied:
                _set(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)
                _set(_M_MMAP_THRESHOLD, _AFTER_MMAP_THRESHOLD)
                _set(_M_TRIM_THRESHOLD, _AFTER_TRIM_THRESHOLD)
                _glibc()[1](0)
                _applied = False
