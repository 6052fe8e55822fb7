"""Reading a full checkpoint's payload at the device's speed, verifying every tensor's checksum.

Two costs besides the device's own can make a load slower than the read: new memory, and a
second copy. On the virtual machines this runs on, faulting in new pages is about as slow as the
device reads (1.5 GiB populated in 0.65-0.95 s against 0.5-0.75 s of O_DIRECT read), so:

* Tensors the caller already has in memory (``into``: the live model's parameters and buffers,
  and the optimizer's state when it has some) are read into a small ring of pre-faulted chunks
  and copied from there into the live tensors, checksummed on the way: no new memory for them,
  and the caller's own ``load_state_dict`` then finds the bytes already in place.
* The rest (a fresh optimizer's state) goes to one aligned buffer whose pages a helper thread
  faults in one chunk at a time, each with a single system call, ahead of the reads into it: the
  populating overlaps the reads instead of running inside each read's submission page by page.

Chunks are read in file order by a second helper thread; the calling thread takes them in the
same order, copies, and checks each tensor as soon as its last byte has arrived.
"""
from __future__ import annotations

import os
import queue
import threading

import torch

import fastio
from lowdiff.errors import CorruptCheckpointError, MissingDeviceError
from lowdiff.format.records import dtype_name
from lowdiff.format.schema import PAYLOAD_OFFSET, TensorEntry, stripe_pieces

LOAD_CHUNK_BYTES = 32 << 20   # a read of this size per queue slot: deep enough, and verify starts early
RING_CHUNKS = 4               # chunks bound for live tensors in flight at once


def placeable(entry: TensorEntry, tensor) -> bool:
    """Whether ``entry``'s bytes can be read straight into ``tensor``: a contiguous CPU tensor of
    the same dtype and shape (anything else is loaded into new memory and left to the caller)."""
    return (isinstance(tensor, torch.Tensor) and entry.nbytes > 0 and tensor.device.type == "cpu"
            and tensor.is_contiguous() and dtype_name(tensor.dtype) == entry.dtype
            and tuple(tensor.shape) == tuple(entry.shape) and tensor.numel() * tensor.element_size() == entry.nbytes)


def apart(placed: dict) -> dict:
    """``placed`` without the tensors whose memory partly overlaps another's (of two, the one
    starting first is kept; e.g. an optimizer state tensor viewing part of a parameter): those
    load into new memory, and the caller's ``load_state_dict`` sets the shared memory as it would
    from any state dict. The same memory under several keys (tied weights, stored under each) is
    kept under all: each key's bytes are written over it, as ``load_state_dict`` copies each."""
    spans = {key: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for key, t in placed.items()}
    kept: set = set()
    reach, last = 0, None
    for key in sorted(spans, key=lambda k: (spans[k][0], -spans[k][1])):
        if spans[key] == last or spans[key][0] >= reach:   # the last kept memory again, or apart from all kept
            kept.add(key)
            last, reach = spans[key], max(reach, spans[key][1])
    return {key: tensor for key, tensor in placed.items() if key in kept}


def read_payload(path: str, reader, payload_bytes: int, tensors, verify: bool, into: dict, *,
                 buffer: fastio.AlignedBuffer | None = None, base: int = 0) -> tuple[fastio.AlignedBuffer, dict]:
    """(buffer, placed): the ``payload_bytes`` at PAYLOAD_OFFSET of the file, holding ``tensors``
    (TensorEntry, offsets absolute in the file); those of the entries in ``placed`` (key -> the
    live tensor of ``into`` they were copied into) in the live tensors, the rest in ``buffer``
    (new memory, or the caller's ``buffer`` from its page-aligned byte ``base`` on; its pages
    that only placed bytes fall in are never touched). Raises CorruptCheckpointError naming the
    tensor whose checksum fails."""
    load = _Load(path, reader, payload_bytes, tensors, verify, into, buffer, base)
    try:
        load.run()
    finally:
        load.stop()
    return load.buffer, load.placed


class _Load:
    def __init__(self, path: str, reader, payload_bytes: int, tensors, verify: bool, into: dict,
                 buffer: fastio.AlignedBuffer | None, base: int) -> None:
        self.path, self.reader, self.verify = path, reader, verify
        self.total = payload_bytes
        self.placed = apart({e.key: into[e.key] for e in tensors if e.key in into and placeable(e, into[e.key])})
        self.entries = sorted(tensors, key=lambda e: e.offset + e.nbytes)   # in order of completion
        self.live = sorted((e for e in tensors if e.key in self.placed), key=lambda e: e.offset)
        rest = [(e.offset - PAYLOAD_OFFSET, e.offset - PAYLOAD_OFFSET + e.nbytes)
                for e in tensors if e.key not in self.placed and e.nbytes]
        self.chunks = [(start, min(start + LOAD_CHUNK_BYTES, self.total))
                       for start in range(0, self.total, LOAD_CHUNK_BYTES)]
        # A chunk holding any byte of a tensor not placed goes to the buffer (its live part is
        # copied from there); one holding only placed tensors' bytes (and padding) to the ring.
        self.to_buffer = [any(s < chunk_end and chunk_start < e for s, e in rest)
                          for chunk_start, chunk_end in self.chunks]
        if base % fastio.ALIGN_BYTES:
            raise ValueError(f"base {base} of the payload in its buffer is not page-aligned")
        self.buffer = buffer if buffer is not None else fastio.aligned_buffer(self.total)
        self.base = base
        self.payload = self.buffer.view(base, base + self.total)
        self.crcs = {e.key: 0 for e in self.live}
        self.populated = [threading.Event() for _ in self.chunks]
        self.free_slots: queue.Queue = queue.Queue()
        self.submitted: queue.Queue = queue.Queue()
        self.ring: fastio.AlignedBuffer | None = None
        self.waits: list = []
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self._populate, name="lowdiff-load-populate", daemon=True),
                        threading.Thread(target=self._submit, name="lowdiff-load-submit", daemon=True)]
        for thread in self.threads:
            thread.start()

    # ------------------------------------------------------------------ helper threads
    def _populate(self) -> None:
        for number, (start, end) in enumerate(self.chunks):
            if self.halt.is_set():
                return
            if self.to_buffer[number]:
                self.buffer.populate(self.base + start, self.base + end)
            self.populated[number].set()

    def _submit(self) -> None:
        try:
            for number, (start, end) in enumerate(self.chunks):
                if self.to_buffer[number]:
                    if not self._wait_for(self.populated[number]):
                        return
                    target, slot = self.payload[start:end], None
                else:
                    slot = self._take_slot()
                    if slot is None:
                        return
                    target = self._slot_view(slot, end - start)
                self.submitted.put((self.reader.submit_read_into(PAYLOAD_OFFSET + start, target), target, slot))
        except BaseException as exc:   # e.g. a closed engine: the loading thread raises it
            self.submitted.put(exc)

    def _wait_for(self, event: threading.Event) -> bool:
        while not event.wait(0.05):
            if self.halt.is_set():
                return False
        return not self.halt.is_set()

    def _take_slot(self):
        if self.ring is None:
            slots = min(RING_CHUNKS, self.to_buffer.count(False))
            self.ring = fastio.aligned_buffer(slots * LOAD_CHUNK_BYTES, populate=True)
            for slot in range(slots):
                self.free_slots.put(slot)
        while not self.halt.is_set():
            try:
                return self.free_slots.get(timeout=0.05)
            except queue.Empty:
                continue
        return None

    def _slot_view(self, slot: int, nbytes: int) -> memoryview:
        assert self.ring is not None
        return self.ring.view(slot * LOAD_CHUNK_BYTES, slot * LOAD_CHUNK_BYTES + nbytes)

    # ------------------------------------------------------------------ the calling thread
    def run(self) -> None:
        checked = 0
        next_live = 0
        for start, end in self.chunks:
            item = self.submitted.get()
            if isinstance(item, BaseException):
                raise item
            wait, target, slot = item
            self.waits.append(wait)
            wait()
            next_live = self._copy_live(start, end, target, next_live)
            if slot is not None:
                self.free_slots.put(slot)
            while checked < len(self.entries) and self._end(self.entries[checked]) <= end:
                self._check(self.entries[checked])
                checked += 1
        if self.verify and checked < len(self.entries):
            entry = self.entries[checked]
            raise CorruptCheckpointError(self.path, f"tensor {entry.key!r} at offset {entry.offset} lies outside "
                                                    f"the payload")

    def _copy_live(self, start: int, end: int, target: memoryview, next_live: int) -> int:
        """Copy the parts of live tensors that lie in the chunk ``start:end`` (its bytes in
        ``target``) into them, their checksums carried on; the index of the first live tensor
        not yet complete."""
        position = next_live
        while position < len(self.live) and self.live[position].offset - PAYLOAD_OFFSET < end:
            entry = self.live[position]
            first = entry.offset - PAYLOAD_OFFSET
            low, high = max(first, start), min(first + entry.nbytes, end)
            if low < high:
                piece = target[low - start:high - start]
                if self.verify:
                    self.crcs[entry.key] = (fastio.crc32c(piece, self.crcs[entry.key]) if entry.crc32c is not None
                                            else fastio.crc32(piece, self.crcs[entry.key]))
                fastio.copy_regions([self.placed[entry.key].data_ptr() + low - first],
                                    [fastio.buffer_address(piece)], [high - low])
            if first + entry.nbytes > end:
                break   # continues in the next chunk
            position += 1
        return position

    def _end(self, entry: TensorEntry) -> int:
        return entry.offset - PAYLOAD_OFFSET + entry.nbytes

    def _check(self, entry: TensorEntry) -> None:
        if not self.verify or not entry.nbytes:
            return
        expected = entry.crc32c if entry.crc32c is not None else entry.crc32
        if entry.key in self.placed:
            good = self.crcs[entry.key] == expected
        else:
            start = entry.offset - PAYLOAD_OFFSET
            data = self.payload[start:start + entry.nbytes]
            checksum = fastio.crc32c if entry.crc32c is not None else fastio.crc32
            good = checksum(data) == expected
        if not good:
            raise CorruptCheckpointError(self.path, f"tensor {entry.key!r} at offset {entry.offset} fails its checksum")

    def stop(self) -> None:
        """Never free memory the kernel may still be writing into: stop the helpers, then wait for
        every read they queued."""
        self.halt.set()
        for thread in self.threads:
            thread.join()
        while not self.submitted.empty():
            item = self.submitted.get()
            if not isinstance(item, BaseException):
                self.waits.append(item[0])
        for wait in self.waits:
            try:
                wait()
            except (OSError, EOFError):
                pass   # the first error was raised already, or a checksum failed first


class StripedPayload:
    """The payload of a striped full checkpoint (docs/format.md, "Striped full checkpoints") as
    one reader: ``submit_read_into`` takes offsets of the logical file (the payload at
    PAYLOAD_OFFSET, as the index's tensor entries give them) and reads each stripe's part from its
    own file through its own engine, so every device works on its share of the reads at once.

    Opening checks what can be checked without reading: a device directory that does not exist
    raises MissingDeviceError (a drive not mounted is never read as an empty or damaged
    checkpoint); a stripe file that is missing or of another size is damage."""

    def __init__(self, path: str, stripes: tuple, unit: int, check_stripes: bool = False) -> None:
        self.path, self.stripes, self.unit = path, stripes, unit
        # ``check_stripes``: each stripe file's CRC-32C, carried on over its bytes as the reads are
        # waited for (in file order, so in each stripe's order), compared by ``check``.
        self._crcs: list | None = [[0, 0] for _ in stripes] if check_stripes else None
        self._readers: list = []
        self._engines: list = []
        home = os.path.dirname(os.path.abspath(path))
        try:
            for number, stripe in enumerate(stripes):
                directory = stripe.dir if stripe.dir is not None else home
                if not os.path.isdir(directory):
                    raise MissingDeviceError(f"{path}: stripe {number} of its payload is in {directory}, which does "
                                             f"not exist (a drive that is not mounted?); mount it and retry, or "
                                             f"resume from an older checkpoint with resume(..., step=...)")
                stripe_path = os.path.join(directory, stripe.file)
                try:
                    size = os.stat(stripe_path).st_size
                except FileNotFoundError:
                    raise CorruptCheckpointError(stripe_path, f"stripe {number} of {path} is missing") from None
                if size != stripe.nbytes:
                    raise CorruptCheckpointError(stripe_path, f"stripe {number} of {path} is {size} bytes, its "
                                                              f"index says {stripe.nbytes}")
                engine = fastio.make_engine(fastio.FastioConfig.from_env())   # one queue per device
                self._engines.append(engine)
                self._readers.append(fastio.Reader(stripe_path, engine=engine))
        except BaseException:
            self.close()
            raise

    def submit_read_into(self, offset: int, out):
        """Start reading ``len(out)`` bytes of the logical file at ``offset``; return the wait."""
        view = memoryview(out).cast("B")
        low, high = offset - PAYLOAD_OFFSET, offset - PAYLOAD_OFFSET + view.nbytes
        pieces = stripe_pieces(self.unit, len(self.stripes), low, high)
        if any(at + nbytes > self.stripes[device].nbytes for device, at, _, nbytes in pieces):
            raise EOFError(f"read of {view.nbytes} bytes at payload offset {low} is outside the stripes of {self.path}")
        # Consecutive units of one device are one read: a chunk becomes a read per device.
        merged: list = []
        for device, at, position, nbytes in pieces:
            if merged and merged[-1][0] == device and merged[-1][1] + merged[-1][3] == at \
                    and merged[-1][2] + merged[-1][3] == position:
                merged[-1][3] += nbytes
            else:
                merged.append([device, at, position, nbytes])
        waits = [self._readers[device].submit_read_into(at, view[position - low:position - low + nbytes])
                 for device, at, position, nbytes in merged]

        def wait() -> None:
            for one in waits:
                one()
            crcs = self._crcs
            if crcs is None:
                return
            for device, at, position, nbytes in merged:
                crc, done = crcs[device]
                if at == done:   # (a stripe is read once, in order: each piece continues its CRC)
                    crcs[device] = [fastio.crc32c(view[position - low:position - low + nbytes], crc), done + nbytes]
        return wait

    def check(self) -> None:
        """With ``check_stripes``, after the whole payload was read: raise CorruptCheckpointError
        naming the first stripe file whose CRC-32C is not its index's (bytes no tensor covers)."""
        home = os.path.dirname(os.path.abspath(self.path))
        for number, (stripe, (crc, done)) in enumerate(zip(self.stripes, self._crcs or ())):
            if done != stripe.nbytes or crc != stripe.crc32c:
                raise CorruptCheckpointError(os.path.join(stripe.dir or home, stripe.file),
                                             f"stripe {number} of {self.path} fails its CRC-32C")

    def close(self) -> None:
        """Idempotent: every reader, then every engine (after their reads)."""
        readers, engines, self._readers, self._engines = self._readers, self._engines, [], []
        for reader in readers:
            reader.close()
        for engine in engines:
            engine.close()

    def __enter__(self) -> StripedPayload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
