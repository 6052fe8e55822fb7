"""Process lifecycle of live lowdiff optimizers: flush at interpreter exit and on SIGTERM."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .wrapper import LowDiffOptimizer

log = logging.getLogger("lowdiff")
live: weakref.WeakSet[LowDiffOptimizer] = weakref.WeakSet()   # optimizers not yet closed
_hooks_installed = False
_terminate_requested = False


class Busy:
    """Marks the main thread as inside lowdiff (holding its locks): a SIGTERM arriving then is
    handled when the call returns, because flushing from inside could deadlock on those locks."""

    __slots__ = ("opt",)

    def __init__(self, opt):
        self.opt = opt

    def __enter__(self):
        self.opt._busy += 1

    def __exit__(self, *exc):
        self.opt._busy -= 1
        if _terminate_requested and not any(o._busy for o in list(live)):
            _terminate()
        return False


def flush_all() -> None:
    for opt in list(live):
        try:
            opt.close()
        except Exception as exc:  # at exit there is nobody left to raise to
            log.error("lowdiff: flushing %s at exit failed: %s", opt.directory, exc)


def _terminate() -> None:
    global _terminate_requested
    _terminate_requested = False
    flush_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _on_sigterm(signum, frame):
    global _terminate_requested
    if any(o._busy for o in list(live)):
        _terminate_requested = True  # finish when the current lowdiff call returns
        return
    _terminate()


def install_exit_hooks() -> None:
    """Flush at interpreter exit and on SIGTERM (if nobody else handles SIGTERM)."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(flush_all)
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)
