"""Process lifecycle of live lowdiff optimizers: flush at interpreter exit and on SIGTERM."""
from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import weakref

log = logging.getLogger("lowdiff")
# Optimizers not yet closed (lowdiff.train.wrapper.LowDiffOptimizer: it imports this module, so the
# set is typed by what is used of them here: flush(), close(), _busy).
live: weakref.WeakSet = weakref.WeakSet()
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
    if _terminate_requested:
        _die("a second SIGTERM arrived")  # the conventional way to insist
    if any(o._busy for o in list(live)):
        _terminate_requested = True  # finish when the current lowdiff call returns ...
        # ... but never wait forever: a call that does not return must not make the process
        # immune to SIGTERM (the steps already durable stay durable).
        timer = threading.Timer(_grace_s(), _insist)
        timer.daemon = True
        timer.start()
        return
    _terminate()


def _grace_s() -> float:
    try:
        return max(0.0, float(os.environ.get("LOWDIFF_TERM_GRACE_S", "60")))
    except ValueError:
        return 60.0


def _insist() -> None:
    """From the grace timer's thread: a second SIGTERM (its handler runs on the main thread, the
    only one that may change signal handlers); SIGKILL if even that is not handled."""
    log.error("lowdiff: SIGTERM: the lowdiff call in progress did not return within %.0f s", _grace_s())
    os.kill(os.getpid(), signal.SIGTERM)
    threading.Event().wait(10)
    os.kill(os.getpid(), signal.SIGKILL)


def _die(why: str) -> None:
    log.error("lowdiff: SIGTERM: %s; terminating without flushing (durable steps are kept)", why)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


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
