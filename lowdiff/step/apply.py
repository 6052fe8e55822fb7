"""Applying recorded steps to parameters and an optimizer: the replay half of exactness.

Recovery replays records with it, and a replica that follows training (LowDiff+) applies captured
steps with it; both need exactly what training did: the recorded hyper-parameters, the recorded
gradient decompressed into ``p.grad``, one optimizer step, then the hyper-parameters after the
scheduler stepped.

``apply_record`` redoes one step. ``GradientBuffers`` redoes many cheaply: every gradient is a view
of one flat buffer per (dtype, device), set once; a worker thread turns each record into one index
and one value tensor per buffer (``prepare``), and the applying thread writes them with one or two
tensor ops per buffer instead of several per parameter. A sparse step clears only the positions the
previous step wrote, so the cost follows the record's size, not the model's; a step whose gradients
are all dense lends the record's values to the parameters as their gradients, without a copy.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import numpy as np
import torch

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format._deltas import flat_positions
from lowdiff.format.records import StepRecord
from lowdiff.format.tree import joined
from lowdiff.step import boundary as capture
from lowdiff.step.compress import decompress_into


def apply_record(record, params: list, optimizer, *, path: str = "<record>") -> None:
    """Redo step ``record.step`` on ``params`` (in param_groups order) through ``optimizer``. A
    step GradScaler skipped changes only the hyper-parameters, as it did in training."""
    objects = record.objects
    if not record.skipped:
        _check_count(record, params, path)
        capture.apply_hyperparameters(optimizer.param_groups, objects["groups_used"])
        with torch.no_grad():
            for p, grad in zip(params, record.grads):
                if grad.kind == "none":
                    p.grad = None
                    continue
                if p.grad is None:
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                decompress_into(grad, p.grad)
        optimizer.step()
    capture.apply_hyperparameters(optimizer.param_groups, objects["groups_after"])


def machine_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def replay_workers() -> int:
    """Threads that decode records ahead of the apply (recovery.pipeline.replay's default; the controller's
    replay estimate assumes it): the machine's cores but the one the applying thread uses, 1 to 8
    (beyond that the apply is the bound): a decoder on the applying thread's core takes the CPU and
    memory bandwidth the optimizer's steps need. On 2 cores (bench_recovery, TopK and Dense) two
    decoders were never faster than one, within that machine's noise of about 20%."""
    return max(1, min(8, machine_cores() - 1))


def _check_count(record, params: list, path: str) -> None:
    if len(record.grads) != len(params):
        raise CorruptCheckpointError(path, f"step {record.step} has {len(record.grads)} gradients, "
                                           f"the optimizer has {len(params)} parameters")


@dataclasses.dataclass(frozen=True)
class _Slot:
    buffer: int        # which flat buffer holds this parameter's gradient
    offset: int        # where, in elements
    numel: int


@dataclasses.dataclass(frozen=True)
class BufferUpdate:
    """What one record writes into one flat buffer: all of it (``indices`` None, ``values`` the
    whole buffer) or the positions ``indices`` (int64, unique)."""

    values: torch.Tensor
    indices: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class PreparedStep:
    record: StepRecord              # hyper-parameters, objects, step
    updates: tuple                  # one BufferUpdate per buffer (empty for a skipped step)
    none: tuple                     # positions of parameters without a gradient at this step
    ready: Callable[[], None] | None = None   # called before the updates are read (pipeline.devicefeed)


_ALL = "all"   # marker: every position of a buffer may be non-zero


class _FlatBuffer:
    """One flat gradient buffer and which of its positions may be non-zero (``dirty``)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, numel: int):
        self.flat = torch.zeros(numel, dtype=dtype, device=device)
        self.dirty: torch.Tensor | str | None = None   # None: all zero; a tensor of positions; or _ALL
        self.version = self.flat._version

    def write(self, update: BufferUpdate) -> None:
        values = update.values.to(self.flat.device, non_blocking=True)
        if update.indices is None:
            self.flat.copy_(values)
            self.dirty = _ALL
        else:
            indices = update.indices.to(self.flat.device, non_blocking=True)
            if self.dirty is _ALL:
                self.flat.zero_()
            elif isinstance(self.dirty, torch.Tensor):
                self.flat.index_fill_(0, self.dirty, 0)
            self.flat.index_copy_(0, indices, values)
            self.dirty = indices
        self.version = self.flat._version

    def check_untouched(self) -> None:
        """An optimizer that changed a gradient in place (the views share the buffer's version
        counter) leaves unknown positions non-zero: clear everything before the next sparse step."""
        if self.flat._version != self.version:
            self.dirty = _ALL


def _buffer_indices(part: list) -> np.ndarray:
    """The positions in the flat buffer of the values of ``part`` ([(slot, grad)] in layout order):
    a dense gradient's whole slot, a sparse one's indices past its slot's offset. One C pass
    whatever the number of gradients (a numpy call each let go of the GIL and took it back
    hundreds of times a record, on replay's decoding threads beside the applying one)."""
    count = len(part)
    counts = np.fromiter((slot.numel if grad.kind == "dense" else grad.indices.numel() for slot, grad in part),
                         dtype=np.int64, count=count)
    offsets = np.fromiter((slot.offset for slot, _ in part), dtype=np.int64, count=count)
    dense = np.fromiter((grad.kind == "dense" for _, grad in part), dtype=np.uint8, count=count)
    sparse = [grad.indices.reshape(-1) for _, grad in part if grad.kind == "sparse"]
    indices = joined(sparse).numpy() if sparse else np.empty(0, dtype=np.int64)
    if indices.dtype not in (np.int32, np.int64):
        indices = indices.astype(np.int64)
    return flat_positions(np.ascontiguousarray(indices), counts, offsets, dense)


class GradientBuffers:
    """Preallocated gradients of ``params`` (param_groups order) for replaying many records."""

    def __init__(self, params: list, *, path: str = "<record>"):
        self.params, self.path = params, path
        keys: dict = {}
        sizes: list[int] = []
        slots = []
        for p in params:
            key = (p.dtype, p.device)
            if key not in keys:
                keys[key] = len(sizes)
                sizes.append(0)
            index = keys[key]
            slots.append(_Slot(index, sizes[index], p.numel()))
            sizes[index] += p.numel()
        self.slots = tuple(slots)
        self._slots_of = [[(position, slot) for position, slot in enumerate(slots) if slot.buffer == index]
                          for index in range(len(sizes))]
        self.layout = tuple((dtype, device, n) for (dtype, device), n in zip(keys, sizes))
        self.dtypes = tuple(dtype for dtype, _, _ in self.layout)
        self.buffers: list[_FlatBuffer] = []   # allocated by attach(): a replay of nothing costs nothing
        self.views: list[torch.Tensor] = []
        self._none: tuple = ()

    def prepare(self, record) -> PreparedStep:
        """The record as one update per buffer (any thread: reads only the fixed layout)."""
        if record.skipped:
            return PreparedStep(record, (), ())
        _check_count(record, self.params, self.path)
        parts: list[list] = [[] for _ in self.layout]   # per buffer: (slot, grad) in layout order
        none = []
        for position, (slot, grad) in enumerate(zip(self.slots, record.grads)):
            if grad.kind == "none":
                none.append(position)
                continue
            self._check_grad(record.step, position, slot, grad)
            parts[slot.buffer].append((slot, grad))
        updates = tuple(self._update(dtype, numel, part) for (dtype, _, numel), part in zip(self.layout, parts))
        return PreparedStep(record, updates, tuple(none))

    def _check_grad(self, step: int, position: int, slot: _Slot, grad) -> None:
        dtype = self.dtypes[slot.buffer]
        if grad.numel != slot.numel or grad.values.dtype != dtype:
            raise CorruptCheckpointError(self.path, f"step {step} records a gradient of {grad.numel} "
                                                    f"{grad.values.dtype} values for parameter {position}, "
                                                    f"which has {slot.numel} {dtype} elements")

    @staticmethod
    def _update(dtype: torch.dtype, numel: int, part: list) -> BufferUpdate:
        if not part:
            return BufferUpdate(torch.empty(0, dtype=dtype), torch.empty(0, dtype=torch.int64))
        values = joined([grad.values if grad.values.dim() == 1 else grad.values.reshape(-1) for _, grad in part])
        if all(grad.kind == "dense" for _, grad in part) and values.numel() == numel:
            return BufferUpdate(values, None)   # every parameter dense: the values are the buffer
        return BufferUpdate(values, torch.from_numpy(_buffer_indices(part)))

    def attach(self) -> None:
        """Allocate the buffers (once) and make every parameter's ``.grad`` its view of them."""
        if not self.buffers:
            self.buffers = [_FlatBuffer(dtype, device, numel) for dtype, device, numel in self.layout]
            self.views = [self.buffers[s.buffer].flat[s.offset:s.offset + s.numel].view(p.shape)
                          for s, p in zip(self.slots, self.params)]
        for p, view in zip(self.params, self.views):
            p.grad = view
        self._none = ()

    def apply(self, prepared: PreparedStep, optimizer) -> None:
        """Redo the prepared step through ``optimizer`` (the caller's thread, in step order)."""
        record = prepared.record
        objects = record.objects
        if not record.skipped:
            if not self.buffers:
                self.attach()
            capture.apply_hyperparameters(optimizer.param_groups, objects["groups_used"])
            self._set_missing(prepared.none)
            if prepared.ready is not None:
                prepared.ready()
            with torch.no_grad():
                for index, (buffer, update) in enumerate(zip(self.buffers, prepared.updates)):
                    if update.indices is None:
                        self._lend(index, update.values.to(buffer.flat.device, non_blocking=True))
                    else:
                        buffer.write(update)
            optimizer.step()
            for buffer in self.buffers:
                buffer.check_untouched()
            self._reattach()
        capture.apply_hyperparameters(optimizer.param_groups, objects["groups_after"])

    def _lend(self, index: int, values: torch.Tensor) -> None:
        """A step that writes all of buffer ``index`` (every parameter of it dense): its
        parameters' ``.grad`` become views of ``values`` for this step, not a copy of them in the
        buffer. A dense record is the size of the model; its values already lie in memory the
        replay holds until the step after this one (recovery.pipeline.replay), and copying them would cost
        a pass over that much memory beside the optimizer's. The buffer keeps what it held (its
        ``dirty`` positions stay true for the next sparse step); ``_reattach`` gives the
        parameters their views of it back after the step."""
        for position, slot in self._slots_of[index]:
            self.params[position].grad = values[slot.offset:slot.offset + slot.numel].view(self.params[position].shape)

    def _set_missing(self, none: tuple) -> None:
        """Parameters without a gradient this step get ``grad = None`` (the optimizer skips them);
        those of the previous step get their views back."""
        for position in self._none:
            self.params[position].grad = self.views[position]
        for position in none:
            self.params[position].grad = None
        self._none = none

    def _reattach(self) -> None:
        """An optimizer that replaced or dropped a ``.grad`` in its step would make later writes to
        the views miss it: give every parameter its view back (those without a gradient this step
        stay None)."""
        if all(p.grad is view for p, view in zip(self.params, self.views)):
            return
        missing = set(self._none)
        for position, (p, view) in enumerate(zip(self.params, self.views)):
            if position not in missing:
                p.grad = view

    def detach(self) -> None:
        for p in self.params:
            p.grad = None
