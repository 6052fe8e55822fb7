"""lowdiff.capture.devicecopy: a step's recorded gradients moved from the GPU to pinned host memory
without a synchronisation in ``step()``.

On the CPU a record's tensors are handed to the differential writer as they are. On CUDA the
writer thread would otherwise call ``.cpu()`` on each (a blocking copy on the default stream, and
device memory held by every record not yet written). Here, at the iteration boundary, the training
thread only *enqueues*: the tensors are joined on the device (one per dtype), a side stream waits
for the compute stream, copies each joined tensor into a pinned host tensor with
``non_blocking=True`` and records an event; the record carries host tensors and a ``ready``
callable, which the writer thread calls (``Event.synchronize``) before it reads them. ``step()``
never waits for the copy.

Why the source tensors are safe: what a compressor records is a tensor of its own (TopK's
``index_select`` values and ``topk`` indices, Dense's and DDP's ``clone``), never the live
``.grad`` that the next backward accumulates into, so nothing writes them after the copy is
enqueued; the joined tensors are new too. Their memory is returned to torch's caching allocator
when the record drops them, which would let the compute stream reuse it while the side stream
still reads it: ``record_stream`` tells the allocator to wait for the side stream first.

Sorted on the device: records hold each sparse gradient's indices in ascending order (the
format's delta encoding needs them so), and TopK hands them over unsorted. Sorting millions of
indices on the writer thread (a 350M model at 1%: 3.5M) cost it more than a training step on an
H100's host, and the writer fell behind; here one sort on the device per dtype orders every
tensor's indices (keys offset past the previous tensors', as the writer would), the values follow,
and indices travel as int32: half the bytes of the copy.

Pinned memory: the host tensors come from torch's caching host allocator (reused once freed and
their copy has completed; it tracks that with its own events). A record holds them until its batch
is written, so the pinned memory in use is bounded by the records not yet durable:
``max_pending_batches * batch_steps`` records (the differential writer's backpressure) times one
record's recorded bytes.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any

import torch

from lowdiff.format.records import Compressed

_I32_LIMIT = 2**31 - 1   # indices of tensors up to this many elements travel as int32


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    # What compressors hand over is 1-D already: no torch call for it (hundreds per step).
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)


class CopyEngine(abc.ABC):
    """The stream and event operations ``DeviceCopy`` needs (an interface): the CUDA one below, and a
    fake with the same methods that lets the CPU tests check the ordering
    (tests/gpu/test_device_pieces.py)."""

    @abc.abstractmethod
    def stream_waits_for_current(self, device: torch.device) -> None:
        """Order the side stream after the work enqueued so far on ``device``'s current stream."""

    @abc.abstractmethod
    def copy_to_host(self, src: torch.Tensor) -> torch.Tensor:
        """Enqueue a copy of ``src`` into new host memory on the side stream; the host tensor."""

    @abc.abstractmethod
    def record_done(self):
        """An object whose ``synchronize()`` returns once every copy enqueued so far has landed."""


class CudaCopyEngine(CopyEngine):
    """One side stream per device; copies into pinned memory on it."""

    def __init__(self, device: torch.device):
        self._stream = torch.cuda.Stream(device=device)

    def stream_waits_for_current(self, device: torch.device) -> None:
        self._stream.wait_stream(torch.cuda.current_stream(device))

    def copy_to_host(self, src: torch.Tensor) -> torch.Tensor:
        host = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=True)
        with torch.cuda.stream(self._stream):
            host.copy_(src, non_blocking=True)
        src.record_stream(self._stream)   # its memory is not reused before this copy has read it
        return host

    def record_done(self):
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


@dataclasses.dataclass
class _Ready:
    """The writer's wait for one record's copies (idempotent; drops the event once waited for)."""
    event: Any

    def __call__(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


class DeviceCopy:
    """Moves the device tensors of recorded gradients to pinned host memory, ordered by events.
    Training thread only: ``to_host(grads)`` -> (host grads, ready) where ``ready()`` blocks
    until they have landed (call it on the thread that reads them)."""

    def __init__(self, device: torch.device, engine: CopyEngine | None = None):
        self.device = device
        self._engine = engine if engine is not None else CudaCopyEngine(device)
        self._offset_cache: dict = {}

    @staticmethod
    def needed(params: list) -> torch.device | None:
        """The CUDA device of ``params`` when their gradients live on one (None: nothing to do)."""
        devices = {p.device for p in params if p.device.type == "cuda"}
        return next(iter(devices)) if len(devices) == 1 and torch.cuda.is_available() else None

    def _moved(self, t) -> bool:
        # Plain tensors on our device only (a DTensor's shape is not its local shape).
        return type(t) is torch.Tensor and t.device == self.device

    def sorted_on_device(self, grads: list) -> list:
        """``grads`` with every unsorted sparse gradient on ``self.device`` sorted by index (its
        values in the same order; indices int32 where they fit), one sort per values dtype."""
        out = list(grads)
        for positions, values, indices, counts in self._sorted_groups(grads):
            for position, v, i in zip(positions, values.split(counts), indices.split(counts)):
                g = grads[position]
                out[position] = Compressed(g.kind, g.numel, v, i, True)
        return out

    def _sorted_groups(self, grads: list) -> list:
        """The unsorted sparse gradients on ``self.device``, sorted by index, one group per values
        dtype: [(positions, values, indices, counts)], values and indices of the whole group back
        to back (tensor by tensor, each ascending), indices int32 where they fit."""
        groups: dict = {}   # values dtype -> positions
        for position, g in enumerate(grads):
            if g.kind == "sparse" and not g.sorted and self._moved(g.values) and self._moved(g.indices):
                groups.setdefault(g.values.dtype, []).append(position)
        sorted_groups = []
        for positions in groups.values():
            items = [grads[p] for p in positions]
            counts = [g.indices.numel() for g in items]
            offsets = self._offsets(tuple((g.numel, c) for g, c in zip(items, counts)))
            keys, order = torch.sort(torch.cat([_flat(g.indices) for g in items]).to(torch.int64) + offsets)
            values = torch.cat([_flat(g.values) for g in items]).index_select(0, order)
            indices = keys - offsets
            if max(g.numel for g in items) <= _I32_LIMIT:
                indices = indices.to(torch.int32)
            sorted_groups.append((positions, values, indices, counts))
        return sorted_groups

    def _offsets(self, shape: tuple) -> torch.Tensor:
        """Per kept index, the start of its tensor in one key space (tensor i's keys start past
        tensors 0..i-1's elements), on the device; built once per layout (TopK keeps the same
        count per tensor at every step), so no step pays a host-to-device copy for it."""
        cached = self._offset_cache.get(shape)
        if cached is None:
            starts, counts, total = [], [], 0
            for numel, count in shape:
                starts.append(total)
                counts.append(count)
                total += numel
            cached = torch.repeat_interleave(torch.tensor(starts, dtype=torch.int64),
                                             torch.tensor(counts)).to(self.device)
            self._offset_cache = {shape: cached}   # one layout at a time
        return cached

    def to_host(self, grads: list) -> tuple[list, _Ready | None]:
        """``grads`` (``Compressed``) with every tensor on ``self.device`` replaced by a view of a
        pinned host copy in flight, and the wait for those copies (None when nothing was on the
        device). The tensors are first joined on the device, one per dtype, so a model of hundreds
        of parameters costs a few copies, not hundreds (each a launch on the training thread).
        Unsorted sparse gradients are sorted first (``sorted_on_device``).

        The views of one dtype lie back to back in parameter order, as the record's encoder reads
        them: it writes them from the pinned memory as they are instead of joining them again (a
        copy of the record's bytes on the writer thread). Per gradient the training thread only
        places views: at 350M parameters (~300 tensors) on an H100's host this function took 13 ms
        a step when it rebuilt every record twice."""
        sorted_parts: dict = {}   # position -> (values, indices) sorted on the device
        for positions, values, indices, counts in self._sorted_groups(grads):
            sorted_parts.update(zip(positions, zip(values.split(counts), indices.split(counts))))
        pieces: dict = {}   # dtype -> flat tensors to join, in parameter order
        owners: dict = {}   # dtype -> [(position, field, numel, shape or None when 1-D)], same order
        for position, g in enumerate(grads):
            on_device = position in sorted_parts   # sorted here: on the device, 1-D
            parts = sorted_parts[position] if on_device else (g.values, g.indices)
            for field, t in zip(("values", "indices"), parts):
                if t is not None and (on_device or self._moved(t)):
                    flat = _flat(t)
                    pieces.setdefault(t.dtype, []).append(flat)
                    owners.setdefault(t.dtype, []).append((position, field, t.numel(), None if flat is t else t.shape))
        if not pieces:
            return grads, None
        # Joined on the compute stream (fresh tensors, which nothing else writes) ...
        joined = {dtype: torch.cat(ts) if len(ts) > 1 else ts[0] for dtype, ts in pieces.items()}
        engine = self._engine
        engine.stream_waits_for_current(self.device)   # ... and copied once that work is done
        placed: dict = {}   # position -> {field: host view}
        for dtype, slots in owners.items():
            views = engine.copy_to_host(joined[dtype]).split([numel for _, _, numel, _ in slots])
            for (position, field, _, shape), view in zip(slots, views):
                placed.setdefault(position, {})[field] = view if shape is None else view.view(shape)
        out = list(grads)
        for position, fields in placed.items():
            g = grads[position]
            out[position] = Compressed(g.kind, g.numel, fields.get("values", g.values),
                                       fields.get("indices", g.indices), g.sorted or position in sorted_parts)
        return out, _Ready(engine.record_done())
