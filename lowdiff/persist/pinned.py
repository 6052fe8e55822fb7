"""lowdiff.persist.pinned: a full checkpoint of CUDA tensors copied to the host off the training
thread, on a side stream: straight into the staging buffer when that buffer can be page-locked
(registered with CUDA), else in chunks through a bounded ring of reused pinned buffers.

Why: a device-to-host copy into pageable memory (the staging buffer fastio writes from with
O_DIRECT) is slow and synchronous; into pinned memory it runs at the link's speed and
asynchronously.

Registered staging (the default on a GPU): the snapshot's staging buffer is registered once with
``cudaHostRegister`` (it is reused from checkpoint to checkpoint, so this is paid once) and every
tensor is copied into its place in it by the DMA engines; nothing else touches the bytes before
fastio writes them. Pinned host memory: the staging buffer, one state's size, which exists
anyway (DCP's ``async_save`` pins a state-sized copy likewise). The ring below adds a host memcpy
per chunk: on one H100 it took 8x a pinned copy of the state (docs/measurements.md).

The ring (where registration fails, e.g. a memory-lock limit): ``slots`` chunks of
``chunk_bytes`` bound the pinned memory at ``slots * chunk_bytes`` (128 MiB by default) whatever
the model's size; each chunk lands in a slot and is then moved into staging by a host memcpy.

Order of events (one checkpoint):

1. training thread, at the iteration boundary (``FullWriter.take``): ``mark()`` records an event on
   each source device's current stream: the state as the optimizer step left it.
2. persist thread (``copy``): the side stream waits for that event. Registered staging: the
   tensors are cut into chunks of ``landing_bytes`` (256 MiB, in staging order), each chunk's
   copies are enqueued in one call per device and an event is recorded after them; ``copy``
   returns a ``Landing`` at once, and the persist thread writes each chunk's bytes to the file as
   soon as its event has completed (``Landing.boundaries``), while the later chunks are still
   crossing the link. Ring: chunk n is copied into slot n % slots with ``non_blocking=True`` and
   an event is recorded after it; before slot s is reused, the event of the chunk that last used
   it is waited for and that chunk is moved from the slot into its place in staging (a host
   memcpy, GIL released: ``fastio.copy_regions``), so up to ``slots`` chunks are in flight while
   the host drains the oldest; ``copy`` returns once every chunk is in staging.
3. training thread, before the next optimizer step (``FullWriter.release``): waits until every
   byte has landed in staging (``Landing.wait_all``). It never waits for the disk.

The sources must stay unmodified from ``mark()`` until every copy has landed (the next forward and
backward only read parameters and optimizer state; ``release`` holds back the optimizer step and
judges by version counters whether anything else wrote them, as for CPU tensors).
"""
from __future__ import annotations

import collections

import torch

import fastio

DEFAULT_CHUNK_BYTES = 64 << 20
# Registered staging lands in pieces this large: the disk writes a piece far more slowly than the
# link fills the next, so smaller pieces would make the file durable hardly sooner, at the cost of
# a wait, a checksum call and a write submission (GIL hand-offs beside training) each.
DEFAULT_LANDING_BYTES = 256 << 20
DEFAULT_SLOTS = 2


def plan_chunks(sizes: list[int], chunk_bytes: int) -> list[list[tuple[int, int, int, int]]]:
    """The pieces ``(source index, start byte, length, offset in the slot)`` of each chunk, in
    source order: every byte of every source exactly once, each chunk at most ``chunk_bytes``
    (a source larger than a chunk is split; small ones share a chunk). Zero-sized sources have no
    piece."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes} must be >= 1")
    chunks: list[list[tuple[int, int, int, int]]] = []
    current: list[tuple[int, int, int, int]] = []
    used = 0
    for index, size in enumerate(sizes):
        start = 0
        while start < size:
            if used == chunk_bytes:
                chunks.append(current)
                current, used = [], 0
            length = min(size - start, chunk_bytes - used)
            current.append((index, start, length, used))
            used += length
            start += length
    if current:
        chunks.append(current)
    return chunks


class CudaRing:
    """The CUDA operations of the ring: pinned slots, a side stream, events."""

    def __init__(self):
        self._streams: dict = {}
        self._marks: list = []

    @staticmethod
    def handles(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def mark(self, devices) -> None:
        """Training thread: the state the copy must see is the one the work enqueued so far makes."""
        self._marks = []
        for device in devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._marks.append((device, event))

    def _stream(self, device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def wait_marked(self) -> None:
        for device, event in self._marks:
            self._stream(device).wait_event(event)
        self._marks = []

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(self._stream(src.device)):
            dst.copy_(src, non_blocking=True)

    def copy_all_async(self, destinations: list, sources: list) -> None:
        """``copy_async`` of each pair, in one torch call per device: the persist thread issues a
        full checkpoint's hundreds of copies while the training thread launches the next forward
        pass, and each torch call lets go of the GIL and has to win it back from that thread."""
        by_device: dict = {}
        for dst, src in zip(destinations, sources):
            pair = by_device.setdefault(src.device, ([], []))
            pair[0].append(dst)
            pair[1].append(src)
        for device, (dsts, srcs) in by_device.items():
            with torch.cuda.stream(self._stream(device)):
                try:
                    torch._foreach_copy_(dsts, srcs, non_blocking=True)
                except (RuntimeError, TypeError):
                    # A torch that refuses lists across devices: the same copies, one call each (a
                    # copy done twice writes the same bytes).
                    for dst, src in zip(dsts, srcs):
                        dst.copy_(src, non_blocking=True)

    def record_done(self, device):
        event = torch.cuda.Event()
        event.record(self._stream(device))
        return event

    @staticmethod
    def register(address: int, nbytes: int) -> bool:
        """Page-lock host memory ``[address, address + nbytes)`` for the GPU's DMA engines (False:
        refused, or a torch without the binding; the ring copies then)."""
        try:
            return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)) == 0
        except (AttributeError, RuntimeError, TypeError):
            return False

    @staticmethod
    def unregister(address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)


def _piece(flat: torch.Tensor, start: int, length: int) -> torch.Tensor:
    return flat if start == 0 and length == flat.numel() else flat[start:start + length]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor (a view, no copy)."""
    flat = tensor.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8, device=tensor.device)


class Landing:
    """A full checkpoint's device-to-host copies into registered staging, still landing, chunk by
    chunk: once chunk k's events have completed, every byte of staging below ``ends[k]`` (an offset
    from the start of staging) holds its final value, because no later chunk writes below it."""

    def __init__(self, ends: list[int], events: list[list]):
        self._ends, self._events = ends, events

    @property
    def last_end(self) -> int:
        """The last boundary: everything the copies write lies below it."""
        return self._ends[-1] if self._ends else 0

    def boundaries(self):
        """Wait for each chunk in turn; yield the offset below which everything has landed."""
        for end, events in zip(self._ends, self._events):
            for event in events:
                event.synchronize()
            yield end

    def wait_all(self) -> None:
        """Until every copy has landed (from any thread, any number of times: waiting on a completed
        event returns at once)."""
        for _ in self.boundaries():
            pass


def landing_ends(starts: list[int], ends: list[int]) -> list[int]:
    """For chunks whose pieces lie at ``[starts[k], ends[k])`` in staging (lowest start, highest end
    of each chunk's pieces), the offset below which nothing is written once chunks up to k have
    landed: the lowest start of any later chunk (bytes no chunk writes, the gaps between tensors,
    are final all along); for the last chunk, the highest end of all."""
    result, later_start = [0] * len(starts), None
    for k in range(len(starts) - 1, -1, -1):
        result[k] = max(ends) if later_start is None else later_start
        later_start = starts[k] if later_start is None else min(later_start, starts[k])
    return result


class PinnedStaging:
    """The bounded pinned ring (see the module doc). ``mark`` on the training thread, then ``copy``
    on the persist thread; one checkpoint at a time (the full writer persists one at a time)."""

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES, slots: int = DEFAULT_SLOTS, ring=None,
                 landing_bytes: int = DEFAULT_LANDING_BYTES):
        if slots < 1:
            raise ValueError(f"slots={slots} must be >= 1")
        self.chunk_bytes, self.slots = chunk_bytes, slots
        self.landing_bytes = landing_bytes       # registered staging: the pieces it lands (and is written) in
        self._ring = ring if ring is not None else CudaRing()
        self._slots: list[torch.Tensor] = []     # allocated at the first copy, then reused
        self.chunks_copied = 0                   # for tests and stats
        self._registered: dict[int, int] = {}    # staging address -> registered bytes
        self._unregistrable: set[int] = set()    # staging addresses registration failed for
        self.direct_copies = 0                   # checkpoints copied straight into registered staging

    @property
    def bound_bytes(self) -> int:
        """The most pinned host memory the ring's slots ever hold (registered staging, when it is
        used, is the snapshot's own buffer: one state)."""
        return self.chunk_bytes * self.slots

    def handles(self, tensor: torch.Tensor) -> bool:
        """Whether ``copy`` moves ``tensor`` through the ring (a CUDA tensor)."""
        return self._ring.handles(tensor)

    def mark(self, tensors) -> None:
        """Training thread, at the boundary: what the copy must wait for (see the module doc)."""
        self._ring.mark(sorted({t.device for t in tensors if self._ring.handles(t)}, key=str))

    def copy(self, destinations: list, sources: list, staging: tuple[int, int] | None = None) -> Landing | None:
        """Persist thread: copy each ``sources[i]`` (contiguous; CPU ones directly) into
        ``destinations[i]`` (host memory of the same bytes), device ones straight into ``staging``
        (address, bytes: the buffer every destination lies in) when it can be registered, else
        through the ring. Returns the ``Landing`` of copies into registered staging, still in
        flight; None when every byte is in place already."""
        on_device = [i for i, src in enumerate(sources) if self._ring.handles(src)]
        with torch.no_grad():
            for dst, src in zip(destinations, sources):
                if not self._ring.handles(src):
                    dst.copy_(src)
            if not on_device:
                return None
            if staging is not None and self._pin(*staging):
                return self._copy_direct([destinations[i] for i in on_device], [sources[i] for i in on_device],
                                         staging[0])
            if not self._slots:
                self._slots = [self._ring.slot(self.chunk_bytes) for _ in range(self.slots)]
            src_bytes = [byte_view(sources[i]) for i in on_device]
            dst_bytes = [byte_view(destinations[i]) for i in on_device]
            self._ring.wait_marked()
            in_flight: collections.deque = collections.deque()
            for n, chunk in enumerate(plan_chunks([s.numel() for s in src_bytes], self.chunk_bytes)):
                if len(in_flight) == self.slots:
                    self._drain(in_flight.popleft(), dst_bytes)
                slot = self._slots[n % self.slots]
                for index, start, length, offset in chunk:
                    self._ring.copy_async(slot[offset:offset + length], src_bytes[index][start:start + length])
                devices = {src_bytes[index].device for index, _, _, _ in chunk}
                in_flight.append((slot, chunk, [self._ring.record_done(d) for d in sorted(devices, key=str)]))
            while in_flight:
                self._drain(in_flight.popleft(), dst_bytes)
        return None

    def _pin(self, address: int, nbytes: int) -> bool:
        """Whether staging ``[address, address + nbytes)`` is registered (registering it now if
        it is not; a buffer grown in place is registered again at its new size)."""
        if self._registered.get(address, -1) >= nbytes:
            return True
        if address in self._unregistrable or not hasattr(self._ring, "register"):
            return False
        if address in self._registered:
            self.forget(address)
        if self._ring.register(address, nbytes):
            self._registered[address] = nbytes
            return True
        self._unregistrable.add(address)   # not tried again for this buffer: the ring copies it
        return False

    def forget(self, address: int) -> None:
        """Unregister staging at ``address`` (before its memory is unmapped)."""
        self._unregistrable.discard(address)
        if self._registered.pop(address, None) is not None:
            self._ring.unregister(address)

    def forget_all(self) -> None:
        for address in list(self._registered):
            self.forget(address)

    def _copy_direct(self, destinations: list, sources: list, base: int) -> Landing:
        """Enqueue every device tensor's copy into its place in registered staging (at ``base``),
        ``landing_bytes`` at a time, one call per device and piece; returns without waiting."""
        self._ring.wait_marked()
        dst_bytes = [byte_view(dst) for dst in destinations]
        src_bytes = [byte_view(src) for src in sources]
        starts, ends, events = [], [], []
        for chunk in plan_chunks([s.numel() for s in src_bytes], self.landing_bytes):
            dsts = [_piece(dst_bytes[index], start, length) for index, start, length, _ in chunk]
            srcs = [_piece(src_bytes[index], start, length) for index, start, length, _ in chunk]
            self._ring.copy_all_async(dsts, srcs)
            devices = sorted({src_bytes[index].device for index, _, _, _ in chunk}, key=str)
            events.append([self._ring.record_done(d) for d in devices])
            starts.append(min(d.data_ptr() for d in dsts) - base)
            ends.append(max(d.data_ptr() + d.numel() for d in dsts) - base)
        self.direct_copies += 1
        return Landing(landing_ends(starts, ends), events)

    def _drain(self, entry: tuple, dst_bytes: list) -> None:
        """Wait for ``entry``'s chunk to land in its slot, then move it into staging (GIL released)."""
        slot, chunk, done = entry
        for event in done:
            event.synchronize()
        base = slot.data_ptr()
        fastio.copy_regions([dst_bytes[index].data_ptr() + start for index, start, _, _ in chunk],
                            [base + offset for _, _, _, offset in chunk], [length for _, _, length, _ in chunk])
        self.chunks_copied += 1
