"""Replay on a GPU: each prepared record's gradient updates are moved to the training device ahead
of its apply, on a side stream, so the optimizer's steps do not wait for host-to-device copies.

A decoding worker (recovery.pipeline.replay) hands each record here right after ``prepare``: its
values and indices are copied into pinned host memory (on the worker, GIL released), then to the
device on the side stream, and an event is recorded after them. The applying thread calls the
record's ``ready()`` before it writes the updates: the compute stream waits for that event (the
host does not), and the device tensors, allocated on the side stream, are marked as used by the
compute stream so the caching allocator does not hand their memory out before it is done. The
device memory in flight is bounded by the replay's window (records in flight, at most two past
WINDOW_BYTES). Exactness does not change: the same values reach the same optimizer on the same
device; only where and when they are copied does.
"""
from __future__ import annotations

import dataclasses

import torch

from lowdiff.step.apply import BufferUpdate, PreparedStep


class DeviceFeed:
    """Stages prepared steps on one CUDA device (see the module doc). ``for_layout`` returns None
    where nothing lives on a CUDA device (the CPU replay is unchanged)."""

    def __init__(self, device: torch.device, layout):
        self.device = device
        # Which flat buffers live on the device (a model may keep some parameters on the CPU).
        self._moves = tuple(buffer_device == device for _, buffer_device, _ in layout)
        self._stream = torch.cuda.Stream(device=device)

    @classmethod
    def for_layout(cls, layout) -> DeviceFeed | None:
        """``layout``: GradientBuffers.layout, (dtype, device, numel) per flat buffer."""
        devices = {device for _, device, _ in layout if device.type == "cuda"}
        if len(devices) != 1 or not torch.cuda.is_available():
            return None   # no GPU, or several: the apply copies as it always did
        return cls(next(iter(devices)), layout)

    def stage(self, prepared: PreparedStep) -> PreparedStep:
        """Any thread: ``prepared`` with its updates on the device (copies in flight) and a
        ``ready`` the applying thread calls before using them."""
        if not prepared.updates:
            return prepared
        staged = []
        with torch.cuda.stream(self._stream):
            for moves, update in zip(self._moves, prepared.updates):
                if not moves:
                    staged.append(update)
                    continue
                staged.append(BufferUpdate(self._to_device(update.values),
                                           None if update.indices is None else self._to_device(update.indices)))
            event = torch.cuda.Event()
            event.record(self._stream)
        return dataclasses.replace(prepared, updates=tuple(staged), ready=_Ready(event, staged, self.device))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        if host.device.type != "cpu" or not host.numel():
            return host
        pinned = host.pin_memory()   # a copy: the read buffer goes back to the reader at once
        return pinned.to(self.device, non_blocking=True)


@dataclasses.dataclass
class _Ready:
    event: torch.cuda.Event
    updates: list
    device: torch.device

    def __call__(self) -> None:
        """Applying thread, before the updates are read: order the compute stream after the copies."""
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.event)
        for update in self.updates:
            for t in (update.values, update.indices):
                if t is not None and t.device.type == "cuda":
                    t.record_stream(stream)
