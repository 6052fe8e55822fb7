"""Replaying differentials onto a loaded full checkpoint, with a pipelined reader.

A background thread reads, checksums, decompresses and decodes the records of the chain in order
into a bounded queue while the caller applies the previous record through the optimizer, so
recovery overlaps I/O and decoding with the optimizer math. A record that fails to verify ends the
replay at the step before it (the valid prefix), which the caller reports; a record of another
format version, or any unexpected error of the reader thread, is raised in the caller.

The batch files arrive already open (``BatchReader``s): a file that a live trainer's retention
deletes meanwhile stays readable through its open descriptor.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time

from lowdiff.apply import apply_record
from lowdiff.errors import CorruptCheckpointError

_END = object()


@dataclasses.dataclass
class ReplayTimes:
    """Where replay spent its time, in seconds: reading record bytes, verifying and decoding them
    (both on the reader thread, overlapping the apply), applying them through the optimizer."""

    read_s: float = 0.0
    decode_s: float = 0.0
    apply_s: float = 0.0
    records: int = 0


def _read_chain(chain: list, first_step: int, stop_step: int | None, out: queue.Queue,
                cancel: threading.Event, times: ReplayTimes) -> None:
    """``chain``: [(manifest entry, open BatchReader)] in step order."""
    expected = first_step
    try:
        for entry, reader in chain:
            if reader.index_error is not None:
                out.put(("warning", f"{reader.index_error}; using the {len(reader.entries)} records found by scanning"))
            for position, step in enumerate(reader.steps):
                if step < expected:
                    continue
                if stop_step is not None and step > stop_step or cancel.is_set():
                    out.put(_END)
                    return
                if step != expected:
                    raise CorruptCheckpointError(reader.path, f"holds step {step} where step {expected} was expected")
                started = time.perf_counter()
                data = reader.read_record_bytes(position)
                read = time.perf_counter()
                record = reader.decode_record(position, data)
                times.read_s += read - started
                times.decode_s += time.perf_counter() - read
                out.put(("record", record))
                expected += 1
            if reader.steps and reader.steps[-1] < entry.last:
                raise CorruptCheckpointError(reader.path, f"ends at step {reader.steps[-1]} but the manifest "
                                                          f"says {entry.last}")
    except (CorruptCheckpointError, OSError, EOFError) as exc:
        out.put(("error", exc))
    except BaseException as exc:  # not damage: the caller raises it
        out.put(("fatal", exc))
    out.put(_END)


def replay(chain: list, base_step: int, params: list, optimizer, *, warn, stop_step=None,
           prefetch_records: int = 4, times: ReplayTimes | None = None):
    """Apply the records after ``base_step`` found in ``chain`` ([(entry, open BatchReader)]).
    Returns (last step, its record); adds where the time went to ``times``."""
    times = times if times is not None else ReplayTimes()
    records: queue.Queue = queue.Queue(maxsize=prefetch_records)
    cancel = threading.Event()
    reader = threading.Thread(target=_read_chain, name="lowdiff-replay-reader", daemon=True,
                              args=(chain, base_step + 1, stop_step, records, cancel, times))
    reader.start()
    step, last = base_step, None
    try:
        while True:
            item = records.get()
            if item is _END:
                break
            kind, value = item
            if kind == "warning":
                warn(f"lowdiff: {value}")
            elif kind == "fatal":
                raise value
            elif kind == "error":
                warn(f"lowdiff: {value}; resuming at step {step}, the last step that verifies")
            else:
                started = time.perf_counter()
                apply_record(value, params, optimizer)
                times.apply_s += time.perf_counter() - started
                times.records += 1
                step, last = value.step, value
    finally:
        cancel.set()
        while reader.is_alive():  # unblock a producer waiting on a full queue
            try:
                records.get(timeout=0.05)
            except queue.Empty:
                pass
    for p in params:
        p.grad = None
    return step, last
