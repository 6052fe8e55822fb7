"""Progress of long recoveries: a tqdm bar on a terminal when tqdm is installed, otherwise an
INFO log line every few seconds (silent unless logging is enabled). Nothing is shown for a
recovery that ends within ``after_s``."""
from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("lowdiff")


class Progress:
    def __init__(self, total: int, what: str, *, after_s: float = 2.0, every_s: float = 5.0):
        self.total, self.what, self.done = total, what, 0
        self._started = time.perf_counter()
        self._after_s, self._every_s = after_s, every_s
        self._last_log = self._started
        self._bar = None

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.perf_counter()
        if now - self._started < self._after_s:
            return
        if self._bar is None and sys.stderr.isatty():
            self._bar = _tqdm(self.total, self.what, self.done)
            if self._bar is not None:
                return
        if self._bar is not None:
            self._bar.update(n)
        elif now - self._last_log >= self._every_s:
            self._last_log = now
            log.info("lowdiff: %s: %d of %d steps (%.0f s)", self.what, self.done, self.total, now - self._started)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _tqdm(total: int, what: str, done: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=done, desc=what, unit="step", leave=False)
