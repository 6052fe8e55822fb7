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

import queue
import threading

from lowdiff.apply import apply_record
from lowdiff.errors import CorruptCheckpointError

_END = object()


def _read_chain(chain: list, first_step: int, stop_step: int | None, out: queue.Queue,
                cancel: threading.Event) -> None:
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
                out.put(("record", reader.read_record(position)))
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
           prefetch_records: int = 4):
    """Apply the records after ``base_step`` found in ``chain`` ([(entry, open BatchReader)]).
    Returns (last step, its record)."""
    records: queue.Queue = queue.Queue(maxsize=prefetch_records)
    cancel = threading.Event()
    reader = threading.Thread(target=_read_chain, name="lowdiff-replay-reader", daemon=True,
                              args=(chain, base_step + 1, stop_step, records, cancel))
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
                apply_record(value, params, optimizer)
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
