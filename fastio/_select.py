"""Choosing the backend at run time, and the process-wide engine every writer and reader shares."""
from __future__ import annotations

import atexit
import logging
import os
import threading

from ._config import FastioConfig
from ._engine import Engine

log = logging.getLogger("fastio")

_lock = threading.Lock()
_engine: Engine | None = None
_engine_pid: int | None = None
_probe_result: tuple[bool, str] | None = None


def uring_available() -> tuple[bool, str]:
    """Probe io_uring once per process: (usable, reason if not)."""
    global _probe_result
    if _probe_result is None:
        try:
            from . import _uring
        except ImportError as exc:  # extension not built
            _probe_result = (False, f"native extension fastio._uring not importable ({exc})")
        else:
            try:
                _uring.probe()
            except OSError as exc:
                _probe_result = (False, f"io_uring_setup failed: {exc.strerror or exc} (errno {exc.errno})")
            else:
                _probe_result = (True, "")
    return _probe_result


def _resolve_backend(config: FastioConfig) -> str:
    if config.backend == "pwrite":
        return "pwrite"
    usable, why = uring_available()
    if config.backend == "uring":
        if not usable:
            raise OSError(f"FASTIO_BACKEND=uring was requested but {why}")
        return "uring"
    if not usable:
        log.warning("fastio: io_uring unavailable, using the pwrite thread-pool backend: %s", why)
        return "pwrite"
    return "uring"


def make_engine(config: FastioConfig) -> Engine:
    """A new engine for ``config`` (callers own it and must close it)."""
    if _resolve_backend(config) == "uring":
        from ._uring_engine import UringEngine

        return UringEngine(config)
    from ._pwrite import PwriteEngine

    return PwriteEngine(config)


def engine() -> Engine:
    """The shared engine of this process, created on first use from the environment's config."""
    global _engine, _engine_pid
    with _lock:
        # A forked child must not use the parent's ring or threads.
        if _engine is None or _engine_pid != os.getpid():
            _engine = make_engine(FastioConfig.from_env())
            _engine_pid = os.getpid()
        return _engine


def backend() -> str:
    """"uring" or "pwrite": the backend this process uses."""
    return engine().name


def _close_shared_engine() -> None:
    global _engine
    with _lock:
        if _engine is not None and _engine_pid == os.getpid():
            _engine.close()
        _engine = None


atexit.register(_close_shared_engine)
