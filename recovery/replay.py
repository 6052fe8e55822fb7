"""Replaying differentials onto a loaded full checkpoint, with a pipelined reader.

A background thread reads, checksums, decompresses and decodes the records of the chain in order
into a bounded queue while the caller applies the previous record through the optimizer, so
recovery overlaps I/O and decoding with the optimizer math. A record that fails to verify ends the
replay at the step before it (the valid prefix), which the caller reports.
"""
from __future__ import annotations

import os
import queue
import threading

import torch

from lowdiff import capture
from lowdiff.batchfile import BatchReader
from lowdiff.compress import decompress_into
from lowdiff.errors import CorruptCheckpointError

_END = object()


def _read_chain(directory: str, chain: list, first_step: int, stop_step: int | None, out: queue.Queue,
                cancel: threading.Event) -> None:
    expected = first_step
    try:
        for entry in chain:
            path = os.path.join(directory, entry.file)
            with BatchReader(path) as reader:
                if reader.index_error is not None:
                    out.put(("warning", f"{reader.index_error}; using the {len(reader.entries)} records found by scanning"))
                for position, step in enumerate(reader.steps):
                    if step < expected:
                        continue
                    if stop_step is not None and step > stop_step or cancel.is_set():
                        out.put(_END)
                        return
                    if step != expected:
                        raise CorruptCheckpointError(path, f"holds step {step} where step {expected} was expected")
                    out.put(("record", reader.read_record(position)))
                    expected += 1
                if reader.steps and reader.steps[-1] < entry.last:
                    raise CorruptCheckpointError(path, f"ends at step {reader.steps[-1]} but the manifest says {entry.last}")
    except (CorruptCheckpointError, OSError, EOFError) as exc:
        out.put(("error", exc))
    out.put(_END)


def replay(directory: str, chain: list, base_step: int, params: list, optimizer, *, stop_step=None,
           warn=print, prefetch_records: int = 4):
    """Apply the records after ``base_step`` found in ``chain``. Returns (last step, its record)."""
    records: queue.Queue = queue.Queue(maxsize=prefetch_records)
    cancel = threading.Event()
    reader = threading.Thread(target=_read_chain, name="lowdiff-replay-reader", daemon=True,
                              args=(directory, chain, base_step + 1, stop_step, records, cancel))
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


def apply_record(record, params: list, optimizer) -> None:
    """Redo one training step: the recorded hyper-parameters and gradient through the optimizer."""
    if len(record.grads) != len(params) and not record.skipped:
        raise CorruptCheckpointError("<record>", f"step {record.step} has {len(record.grads)} gradients, "
                                                 f"the optimizer has {len(params)} parameters")
    if not record.skipped:
        capture.apply_hyperparameters(optimizer.param_groups, record.objects["groups_used"])
        with torch.no_grad():
            for p, grad in zip(params, record.grads):
                if grad.kind == "none":
                    p.grad = None
                    continue
                if p.grad is None:
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                decompress_into(grad, p.grad)
        optimizer.step()
    capture.apply_hyperparameters(optimizer.param_groups, record.objects["groups_after"])
