"""Fetching a bucket's committed objects while a resume uses them: ``BucketFetch`` downloads the
objects a reader says it will need, in that order, a few ahead of the one it waits for, each
checked against the size and CRC-32C its commit names (lowdiff.tiers.bucket.download). A resume
asks for the full checkpoint and its chain, waits for the full checkpoint, and starts replaying
while the chain's later batch files are still being fetched. ``ObjectRanges`` reads parts of one
object (a file's index, when its records are fetched later) by ranged GETs.
"""
from __future__ import annotations

import os
import threading

from lowdiff.format.container import BucketManifest
from lowdiff.tiers.bucket import download
from lowdiff.tiers.objectstore import S3Client

__all__ = ["BucketFetch", "ObjectRanges"]

AHEAD = 2   # objects fetched past the one last waited for: enough to overlap, bounded in memory and disk
TAIL_BYTES = 64 << 10   # what a file's index is read from at once: its end (trailer, index), in one GET


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

    def arrived(self, name: str) -> str | None:
        """The path of ``name`` if it has arrived, checked (None: not yet, or its fetch failed)."""
        with self._cond:
            result = self._results.get(name)
        return result if isinstance(result, str) else None

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


class ObjectRanges:
    """Parts of one committed object read by ranged GETs, as ``fastio.Reader`` reads a file's
    (``read(offset, n)``, ``size``): for a file's index when its records are not wanted yet (a
    partitioned resume plans the chain by its files' indexes before the replay fetches them). The
    first bytes and the last ``TAIL_BYTES`` are each fetched once and kept, so a container's
    preamble, trailer and index cost two requests. The size is the one the commit names; the
    bytes are checked by the container's own checksums (its index CRC), the object's CRC-32C only
    when it is fetched whole."""

    HEAD_BYTES = 4096

    def __init__(self, client: S3Client, committed: BucketManifest, name: str):
        self.client, self.name = client, name
        self.size = committed.objects[name][0]
        self._parts: list = []   # (offset, bytes) fetched

    def read(self, offset: int, nbytes: int) -> bytes:
        for start, data in self._parts:
            if start <= offset and offset + nbytes <= start + len(data):
                return data[offset - start:offset - start + nbytes]
        if offset + nbytes <= self.HEAD_BYTES:
            start = 0
            length = min(self.HEAD_BYTES, self.size)
        elif offset >= self.size - TAIL_BYTES:
            start = max(0, self.size - TAIL_BYTES)
            length = self.size - start
        else:
            return self.client.get_range(self.name, offset, nbytes)
        data = self.client.get_range(self.name, start, length)
        if len(data) != length:
            raise OSError(f"{self.client.url}/{self.name} sent {len(data)} of bytes {start}..{start + length}: "
                          f"it is not the {self.size}-byte object its commit names")
        self._parts.append((start, data))
        return data[offset - start:offset - start + nbytes]

    def close(self) -> None:
        self._parts = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
