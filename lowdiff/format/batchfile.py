"""Writing and reading differential batch files: preamble, records, JSON index, trailer."""
from __future__ import annotations

import logging

import fastio
from lowdiff import faults
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import container
from lowdiff.format.records import RECORD_HEADER, RECORD_MAGIC, decode_record, placed_at, record_length
from lowdiff.format.schema import BatchIndex

log = logging.getLogger("lowdiff")


def write_batch(path: str, session: str, records: list, *, run: str | None = None, engine=None,
                kind: int = container.KIND_DIFF, index_fields: dict | None = None) -> int:
    """Write ``records`` ([(step, [buffers])], consecutive steps) to ``path`` and commit it
    atomically (fastio.Writer). Returns the file's size in bytes. ``kind`` and ``index_fields``
    (added to the index) are for files of this layout that are not plain batches (shares)."""
    entries = []
    with fastio.Writer(path, priority=fastio.URGENT, engine=engine) as writer:
        writer.write(container.preamble_bytes(kind))
        for step, buffers in records:
            offset = writer.size
            for buffer in placed_at(offset, buffers):
                writer.write(buffer)
            entries.append([step, offset, writer.size - offset])
        faults.point("batch-write")
        body = BatchIndex(records[0][0], records[-1][0], session, run, tuple(map(tuple, entries))).to_json()
        body.update(index_fields or {})
        index = container.encode_index(body)
        index_offset = writer.write(index)
        writer.write(container.trailer_bytes(index_offset, index, kind))
        return writer.size


class BatchReader:
    """Reads the records of one batch file. When the index is damaged the records are found by
    scanning from the start, so the valid prefix of a torn or damaged file is still usable."""

    def __init__(self, path: str, *, engine=None):
        self.path = path
        self._reader = fastio.Reader(path, engine=engine)
        self.index_error: CorruptCheckpointError | None = None
        try:
            index, self.entries = self._read_index()
            self.index: BatchIndex | None = index
        except BaseException:  # VersionMismatchError, a foreign file, I/O errors (the scan's too)
            self._reader.close()
            raise

    def _read_index(self) -> tuple[BatchIndex | None, list]:
        """(index, entries); (None, what a scan finds) when the index is damaged."""
        try:
            raw = container.read_index(self.path, self._reader.read, self._reader.size, container.KIND_DIFF)
            index = BatchIndex.from_json(self.path, raw, self._reader.size - container.TRAILER.size)
            return index, list(index.records)
        except CorruptCheckpointError as exc:
            if isinstance(exc, container.ForeignFileError):
                raise
            self.index_error = exc
        return None, self._scan()   # outside the handler: an error here is not chained to the index's

    def _scan(self) -> list:
        entries = []
        offset = container.PREAMBLE.size
        while offset + RECORD_HEADER.size <= self._reader.size:
            header = self._reader.read(offset, RECORD_HEADER.size)
            if header[:4] != RECORD_MAGIC:
                break
            step, nbytes = record_length(header)
            if offset + nbytes > self._reader.size:
                break
            entries.append((step, offset, nbytes))
            offset += nbytes
        return entries

    @property
    def size(self) -> int:
        """The file's length in bytes."""
        return self._reader.size

    @property
    def steps(self) -> list[int]:
        return [e[0] for e in self.entries]

    def read_record(self, position: int):
        """Decode the record at ``position`` of the entry list (verifies its checksum)."""
        return self.decode_record(position, self.read_record_bytes(position))

    def read_record_bytes(self, position: int) -> bytearray:
        """The bytes of the record at ``position``, unverified (``decode_record`` checks them)."""
        step, offset, nbytes = self.entries[position]
        if offset + nbytes > self._reader.size:
            raise CorruptCheckpointError(self.path, f"record of step {step} at offset {offset} runs past the end "
                                                    f"of the file")
        data = bytearray(nbytes)
        self._reader.read_into(offset, data)
        return data

    def prepare_read(self, position: int) -> None:
        """Replay calls this in step order before ``read_for_replay(position)`` runs in a worker
        (readers whose bytes arrive in order, e.g. recovery.partitioned.chain's, fetch them here); a
        batch file reads each record in the worker, so there is nothing to do."""

    def read_for_replay(self, position: int, memory) -> tuple:
        """(bytes, buffer) of the record at ``position``, unverified, for ``decode_record(...,
        owned=True)``: read whole into a page-aligned buffer from ``memory`` (``take(nbytes)`` ->
        fastio.AlignedBuffer), which the caller gives back once the record is done with. The
        page-aligned span of the file that holds the record is read, so it goes through O_DIRECT;
        the record's own range, at any offset, would go through the page cache."""
        step, offset, nbytes = self.entries[position]
        if offset + nbytes > self._reader.size:
            raise CorruptCheckpointError(self.path, f"record of step {step} at offset {offset} runs past the end "
                                                    f"of the file")
        start = offset - offset % fastio.ALIGN_BYTES
        end = min(-(-(offset + nbytes) // fastio.ALIGN_BYTES) * fastio.ALIGN_BYTES, self._reader.size)
        buffer = memory.take(end - start)
        self._reader.read_into(start, buffer.view(0, end - start))
        return buffer.view(offset - start, offset - start + nbytes), buffer

    def decode_record(self, position: int, data, *, owned: bool = False):
        """Verify and decode ``data``, the bytes of the record at ``position`` (``owned``: handed
        over for good, see lowdiff.format.records.decode_record)."""
        step, offset, _ = self.entries[position]
        return decode_record(data, self.path, offset, expected_step=step, owned=owned)

    def close(self) -> None:
        self._reader.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
