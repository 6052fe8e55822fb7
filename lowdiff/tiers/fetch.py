"""Fetching a bucket's committed objects while a resume uses them: ``BucketFetch`` downloads the
objects a reader says it will need, in that order, a few ahead of the one it waits for, each
checked against the size and CRC-32C its commit names (lowdiff.tiers.bucket.download). A resume
asks for the full checkpoint and its chain, waits for the full checkpoint, and starts replaying
while the chain's later batch files are still being fetched.
"""
from __future__ import annotations

import os
import threading

from lowdiff.format.container import BucketManifest
from lowdiff.tiers.bucket import download
from lowdiff.tiers.objectstore import S3Client

__all__ = ["BucketFetch"]

AHEAD = 2   # objects fetched past the one last waited for: enough to overlap, bounded in memory and disk


class BucketFetch:
    """Downloads objects of ``committed`` into ``directory`` (a new temporary directory) with
    ``threads`` threads. Call order: ``expect(names)`` (the order the reader will ask in; a new
    call replaces the order, what arrived stays), ``wait(name)`` for each (its path, or the
    error its download ended in: CorruptCheckpointError or ObjectStoreError, both naming the
    object's s3:// URL), ``close()``. An object is fetched only once at most ``ahead`` objects
    after the last one waited for, so a reader that stops early does not pay for the rest."""

    def __init__(self, client: S3Client, committed: BucketManifest, directory: str, *, threads: int = 2,
                 ahead: int = AHEAD):
        self.client, self.committed, self.directory = client, committed, directory
        self.ahead = ahead
        self.fetched: list = []                  # names, in the order their downloads began
        self._order: list = []
        self._waited = -1                        # position in _order of the last name waited for
        self._results: dict = {}                 # name -> path | BaseException
        self._busy: set = set()
        self._closed = False
        self._cond = threading.Condition()
        self._threads = [threading.Thread(target=self._run, name="lowdiff-s3-fetch", daemon=True)
                         for _ in range(max(1, threads))]
        for thread in self._threads:
            thread.start()

    def url(self, name: str) -> str:
        return f"{self.client.url}/{name}"

    def expect(self, names) -> None:
        with self._cond:
            self._order, self._waited = list(names), -1
            self._cond.notify_all()

    def wait(self, name: str) -> str:
        with self._cond:
            if name not in self._order:
                self._order.append(name)
            self._waited = max(self._waited, self._order.index(name))
            self._cond.notify_all()
            while name not in self._results:
                self._cond.wait()
            result = self._results[name]
        if isinstance(result, BaseException):
            raise result
        return result

    def _next(self) -> str | None:
        """The first name of the order allowed and not yet taken (with the lock held)."""
        for name in self._order[:self._waited + self.ahead + 1]:
            if name not in self._results and name not in self._busy:
                return name
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (name := self._next()) is None:
                    self._cond.wait()
                if self._closed:
                    return
                assert name is not None
                self._busy.add(name)
                self.fetched.append(name)
            path = os.path.join(self.directory, name)
            result: str | BaseException = path
            try:
                if name not in self.committed.objects:
                    raise KeyError(f"{self.url(name)} is not named by the bucket's commit")
                download(self.client, self.committed, name, path)
            except BaseException as exc:   # handed to the waiting reader, in its thread
                result = exc
            with self._cond:
                self._busy.discard(name)
                self._results[name] = result
                self._cond.notify_all()

    def close(self) -> None:
        """Stop fetching; a download in flight ends first (its own deadline bounds it)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
