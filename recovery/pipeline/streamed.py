"""A chain of batch files that arrive while the replay runs (from an object store): the replay
gets the whole chain up front, as (entry, reader) pairs, but each reader opens its file only when
the replay first reaches it, waiting for its download then (``arrive(entry) -> BatchReader``).

The first file that cannot be had (its download failed its checks, the object is gone, its index
is not what the manifest says) ends the chain there, as a missing file ends a directory's chain:
a warning names it, its reader and every later one hold no records, so the replay stops at the
last step before it and no later file is fetched. An error ``fatal(exc)`` says is no property of
the file (the store cannot be reached) is raised instead: the chain's files may well be fine.
"""
from __future__ import annotations

from typing import Any

from lowdiff.errors import CorruptCheckpointError, VersionMismatchError

__all__ = ["StreamedChain"]


class StreamedChain:
    """The chain of ``entries`` continuing the full checkpoint of ``base_step``; ``arrive(entry)``
    waits for an entry's file and returns it open and checked (raising what went wrong);
    ``where(entry)`` is what messages call it (its s3:// URL)."""

    def __init__(self, entries: list, base_step: int, arrive, where, warn, fatal=lambda exc: False):
        self._arrive, self._where, self._warn, self._fatal = arrive, where, warn, fatal
        self.base_step = base_step
        self.ended = False
        self.pairs = [(entry, _ArrivingBatch(self, entry)) for entry in entries]

    def open(self, entry):
        """The reader of ``entry`` (None: the chain ended at or before it)."""
        if self.ended:
            return None
        try:
            return self._arrive(entry)
        except (CorruptCheckpointError, VersionMismatchError, OSError, EOFError, LookupError) as exc:
            if self._fatal(exc):
                raise
            self.ended = True
            self._warn(f"lowdiff: {exc}; the chain from step {self.base_step} ends at step {entry.first - 1}")
            return None

    def reach(self) -> int:
        """Open every file now (waiting for all of them); the last step the chain's files reach
        by their entries, up to the first that cannot be had."""
        reach = self.base_step
        for entry, reader in self.pairs:
            if reader.opened() is None:
                break
            reach = entry.last
        return reach

    def close(self) -> None:
        for _, reader in self.pairs:
            reader.close()


class _ArrivingBatch:
    """A BatchReader that opens when first used (what recovery.pipeline.replay reads of one)."""

    _EMPTY: list = []

    def __init__(self, chain: StreamedChain, entry):
        self._chain, self._entry = chain, entry
        self._reader: Any = None
        self._tried = False

    def opened(self):
        if not self._tried:
            self._tried = True
            self._reader = self._chain.open(self._entry)
        return self._reader

    @property
    def path(self) -> str:
        return self._chain._where(self._entry)

    @property
    def entries(self) -> list:
        reader = self.opened()
        return self._EMPTY if reader is None else reader.entries

    @property
    def steps(self) -> list:
        return [e[0] for e in self.entries]

    @property
    def index_error(self):
        reader = self.opened()
        return None if reader is None else reader.index_error

    def prepare_read(self, position: int) -> None:
        self._reader.prepare_read(position)

    def read_for_replay(self, position: int, memory) -> tuple:
        return self._reader.read_for_replay(position, memory)

    def decode_record(self, position: int, data, *, owned: bool = False):
        return self._reader.decode_record(position, data, owned=owned)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
