"""Full checkpoints: snapshot the state into aligned staging memory, persist it, load it back.

Every tensor is copied once, into a page-aligned staging buffer at the offset it will have in the
file (``Snapshot.stage`` on the training thread, then ``Snapshot.copy``, usually on the persist
thread while training goes on; see the class). fastio writes the buffer without another copy
(O_DIRECT from staging).
"""
from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

import fastio
from lowdiff import faults
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import container, tree
from lowdiff.format.payloadread import StripedPayload, read_payload
from lowdiff.format.records import dtype_from_name, dtype_name
from lowdiff.format.schema import (
    PAGE,
    PAYLOAD_OFFSET,
    SMALL_TENSOR_ALIGN,
    Checksummed,
    FullIndex,
    FullState,
    Section,
    TensorEntry,
    TrainedWith,
)


class Placement(NamedTuple):
    """Where a tensor goes in the payload region of the next full checkpoint. (A tuple: a layout
    of hundreds is planned and compared with the last one at every full checkpoint.)"""
    key: str
    dtype: str
    shape: tuple
    offset: int      # within the payload region
    nbytes: int


def plan_layout(tensors: list) -> tuple[list[Placement], int]:
    """Offsets for ``[(key, tensor)]``: page-aligned for large tensors, packed for small ones."""
    entries, offset = [], 0
    for key, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        align = PAGE if nbytes >= PAGE else SMALL_TENSOR_ALIGN
        offset = -(-offset // align) * align
        entries.append(Placement(key, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    return entries, -(-offset // PAGE) * PAGE


def _version_counters(tensors) -> list | None:
    """The tensors' version counters (bumped by every in-place change); None if one has none
    (an inference tensor)."""
    try:
        return [tensor._version for tensor in tensors]
    except RuntimeError:
        return None


def _staging_view(staging: torch.Tensor, entry: Placement) -> torch.Tensor:
    dtype = dtype_from_name(entry.dtype, "<staging>")
    return staging[entry.offset:entry.offset + entry.nbytes].view(dtype).view(entry.shape)


class Snapshot:
    """A full checkpoint held in staging memory, ready to persist. Reuses its buffer across steps
    when the layout fits (the caller waits for the previous persist before staging the next).

    Taking one has two halves. ``stage`` runs on the training thread at the iteration boundary:
    it splits the state into a skeleton and tensor references and notes each tensor's version
    counter (cheap, no tensor data is touched). ``copy`` moves the bytes into staging and may run
    on another thread, overlapping the next forward/backward pass, as long as nothing modifies
    the staged tensors in place before it ends: the training thread waits for it before the next
    optimizer step, and ``modified_since_stage`` tells whether anything did anyway.
    """

    # Whether ``device_copy`` is used: CUDA tensors copied off the training thread through it.
    supports_device_copy = True

    def __init__(self):
        # For CUDA sources: an object with handles(tensor) and copy(destinations, sources), which
        # copies them off the training thread (lowdiff.persist.pinned.PinnedStaging).
        self.device_copy = None
        self._buffer: fastio.AlignedBuffer | None = None
        self.spare: fastio.AlignedBuffer | None = None  # pre-faulted in the background by prepare()
        self.step = -1
        self.entries: list[Placement] = []
        self.payload_bytes = 0
        self._skeleton = None
        self._destinations = None  # (entries, staging views, their addresses, sizes) of the last copy
        self._staged = None        # (tensors, versions) between stage() and release_sources()
        self._checksums = None     # CRC-32C per entry with bytes, when the copy computed them
        self._landing = None       # device copies still landing in staging (lowdiff.persist.pinned.Landing)
        self.meta: TrainedWith | None = None
        self._fixed: tuple | None = None   # (engine, buffer, accepted) of the last registration tried

    def stage(self, step: int, state: dict, meta: TrainedWith) -> None:
        """Record what to copy: ``state`` (nested dicts/lists of tensors and plain values).

        The skeleton is final here: split_tensors builds every container afresh and its leaves
        are immutable values, so later training cannot change it.
        """
        skeleton, tensors = tree.split_tensors(state)
        self.step, self._skeleton, self.meta = step, skeleton, meta
        self._staged = (tensors, _version_counters(t for _, t in tensors))

    def staged_tensors(self) -> list:
        """The live tensors ``stage`` recorded (until ``release_sources``)."""
        return [t for _, t in self._staged[0]] if self._staged is not None else []

    def copyable_in_background(self) -> bool:
        """Whether ``copy`` may run off the training thread: every tensor is on the CPU, dense,
        contiguous and without a lazy conjugate/negative bit (so its bytes are its values and a
        plain memcpy reads it), and has a version counter to check. CUDA tensors qualify too when a
        ``device_copy`` is set."""
        tensors, versions = self._staged
        device_copy = self.device_copy
        return versions is not None and all(
            (t.device.type == "cpu" or (device_copy is not None and device_copy.handles(t)))
            and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() for _, t in tensors)

    def copy(self, on_training_thread: bool) -> None:
        """Copy the staged tensors into staging memory, each at its offset in the file."""
        tensors, _ = self._staged
        entries, payload_bytes = plan_layout(tensors)
        if self._buffer is None or self._buffer.capacity_bytes < payload_bytes:
            self.drop_buffer()
            spare, self.spare = self.spare, None
            if spare is not None and spare.capacity_bytes >= payload_bytes:
                self._buffer = spare
            else:
                self._buffer = fastio.aligned_buffer(payload_bytes, populate=True)
        if self._destinations is None or self._destinations[0] != entries:
            # The layout rarely changes between checkpoints: keep the staging views, their
            # addresses and sizes.
            staging = self._buffer.tensor(payload_bytes)
            views = [_staging_view(staging, e) for e in entries if e.nbytes]
            self._destinations = (entries, views, [v.data_ptr() for v in views],
                                  [e.nbytes for e in entries if e.nbytes])
        _, destinations, addresses, sizes = self._destinations
        sources = [tensor for entry, (_, tensor) in zip(entries, tensors) if entry.nbytes]
        self._checksums = self._landing = None
        with torch.no_grad():
            if not sources:
                pass
            elif not on_training_thread and self.device_copy is not None and any(
                    self.device_copy.handles(src) for src in sources):
                # checksums: computed by persist(), as the bytes land; the whole buffer, which may be
                # page-locked once
                self._landing = self.device_copy.copy(destinations, sources,
                                                      (self._buffer.address, self._buffer.capacity_bytes))
            elif not on_training_thread:
                # Plain memcpy on this thread without the GIL (torch's copy would use the intra-op
                # thread pool, which the training thread is using right now), checksumming each
                # piece while it is in cache.
                self._checksums = fastio.copy_regions(addresses, [s.data_ptr() for s in sources], sizes,
                                                      checksums=True)
            elif all(src.device.type == "cpu" for src in sources):
                # One call for all tensors: the GIL is released once, not once per tensor, so
                # background Python threads cannot stretch the copy with hundreds of GIL hand-offs.
                torch._foreach_copy_(destinations, sources)
            else:
                for dst, src in zip(destinations, sources):  # device tensors: one by one to the host
                    dst.copy_(src)
        self.entries, self.payload_bytes = entries, payload_bytes

    def drop_buffer(self) -> None:
        """Let the staging buffer go (a device copy that page-locked it unlocks it first, and the
        I/O engine that registered it lets it go: its memory is unmapped once nothing refers to it)."""
        if self._buffer is not None and self.device_copy is not None and hasattr(self.device_copy, "forget"):
            self.device_copy.forget(self._buffer.address)
        self.release_fixed()
        self._buffer = None
        self._destinations = None

    def register_fixed(self, engine) -> None:
        """Register the staging buffer with the engine that will write it (fastio fixed I/O): the
        kernel pins its pages once instead of at every write (about 1 ms of CPU per 60 MiB here,
        beside training). Tried once per engine and buffer; where refused (no io_uring, a memlock
        limit) writes go as before. Another snapshot's registration on the same engine replaces
        ours (one at a time): then ours is registered again at its next write."""
        if self._buffer is None:
            return
        engine = engine if engine is not None else fastio.engine()
        if engine.registered is self._buffer:
            return
        if self._fixed is not None and self._fixed[0] is engine and self._fixed[1] is self._buffer \
                and not self._fixed[2]:
            return   # refused before for this buffer
        self._fixed = (engine, self._buffer, engine.register_buffer(self._buffer))

    def release_fixed(self) -> None:
        """Drop the engine's registration of the staging buffer, if it still holds it (the engine
        keeps a registered buffer alive)."""
        if self._fixed is not None:
            engine, buffer, _ = self._fixed
            self._fixed = None
            if engine.registered is buffer:
                engine.register_buffer(None)

    def wait_landed(self) -> None:
        """Until every byte a device copy puts in staging has landed (at once if none is in flight)."""
        if self._landing is not None:
            self._landing.wait_all()

    def _landed_pieces(self, with_bytes: list):
        """The payload as back-to-back page-aligned pieces, each yielded as soon as the device
        copies below its end have landed (so the file is written while later chunks still cross
        the link), each tensor's checksum computed once all its bytes are in."""
        assert self._buffer is not None and self._landing is not None
        checksums: list[int] = []
        written = 0
        last = self._landing.last_end
        for boundary in itertools.chain(self._landing.boundaries(), (self.payload_bytes,)):
            # Whole pages (each piece goes from staging to the disk without a copy), except at the
            # end: nothing lands above the last boundary, so the rest of the payload goes with it.
            end = self.payload_bytes if boundary >= min(last, self.payload_bytes) else boundary // PAGE * PAGE
            done = len(checksums)
            while done < len(with_bytes) and with_bytes[done].offset + with_bytes[done].nbytes <= end:
                done += 1
            if done > len(checksums):
                regions = with_bytes[len(checksums):done]
                checksums += fastio.crc32c_regions([self._buffer.address + e.offset for e in regions],
                                                   [e.nbytes for e in regions])
            if end > written:
                yield self._buffer.view(written, end)
                written = end
        self._checksums = checksums

    def modified_since_stage(self) -> list[str]:
        """Keys of staged tensors modified in place since ``stage`` (by their version counters)."""
        tensors, versions = self._staged
        if versions is None:
            return []
        return [key for (key, tensor), version in zip(tensors, versions) if tensor._version != version]

    def release_sources(self) -> None:
        """Drop the references to the live tensors (after the copy was judged)."""
        self._staged = None

    def prepare(self, payload_bytes: int) -> None:
        """Allocate and pre-fault staging for a state of about ``payload_bytes`` (call off the
        training thread), so the next ``copy`` runs at memcpy speed instead of page-fault speed."""
        if self._buffer is None or self._buffer.capacity_bytes < payload_bytes:
            self.spare = fastio.aligned_buffer(payload_bytes, populate=True)

    def persist(self, path: str, session: str, *, run: str | None = None, engine=None,
                before_commit=None, stripe=None) -> int | None:
        """Write the snapshot to ``path`` and commit it. Returns the file size in bytes.

        ``before_commit()`` is asked last, with everything written: if it returns False the file
        is discarded (nothing appears at ``path``) and persist returns None.

        ``stripe(payload) -> (unit, (Stripe, ...))``, when given, writes the payload as stripes on
        several devices and returns them once every stripe is durable (lowdiff.store.stripes); ``path``
        then holds everything but the payload, and names the stripes (docs/format.md, "Striped
        full checkpoints"), so the checkpoint exists only once every stripe does. When it returns
        None, the stripes written are named by nothing: the caller removes them.
        """
        payload = memoryview(b"")
        if self.payload_bytes:
            assert self._buffer is not None, "copy() allocates the buffer it counts payload_bytes in"
            payload = self._buffer.view(0, self.payload_bytes)
        stripes: tuple = ()
        unit = 0
        if stripe is not None and self.payload_bytes:
            unit, stripes = stripe(payload)   # (if before_commit refuses, the caller removes them)
        elif self.payload_bytes:
            self.register_fixed(engine)
        objects = tree.dumps(self._skeleton)
        with_bytes = [e for e in self.entries if e.nbytes]
        pieces = None
        if self._landing is not None and stripe is None and self.payload_bytes:
            pieces = self._landed_pieces(with_bytes)   # sets the checksums as it goes
        else:
            self.wait_landed()
        if pieces is None and self._checksums is None and with_bytes:   # the copy did not compute them: all in one call
            assert self._buffer is not None
            self._checksums = fastio.crc32c_regions([self._buffer.address + e.offset for e in with_bytes],
                                                    [e.nbytes for e in with_bytes])
        meta = self.meta
        assert meta is not None, "stage() records what the checkpoint was trained with"

        def make_index(objects_section: Section) -> FullIndex:
            # (called once the payload is written: the checksums of landed pieces are known then)
            checksums = iter(self._checksums or ())
            tensors = tuple(TensorEntry(PAYLOAD_OFFSET + e.offset, e.nbytes,
                                        next(checksums) if e.nbytes else fastio.crc32c(b""),
                                        key=e.key, dtype=e.dtype, shape=e.shape)
                            for e in self.entries)
            names, aliases, optimizer_class, compressor = meta.fields()
            return FullIndex(self.step, session, run, self.payload_bytes, tensors, objects_section, names, aliases,
                             optimizer_class, compressor, stripes=stripes, stripe_bytes=unit)
        return write_full_file(path, container.KIND_FULL, memoryview(b"") if stripes else payload, objects,
                               make_index, engine=engine, before_commit=before_commit, pieces=pieces)


def write_full_file(path: str, kind: int, payload, objects: bytes, make_index, *, engine=None,
                    before_commit=None, pieces=None) -> int | None:
    """The layout of a full checkpoint (and of a share of one): preamble, ``payload`` from the
    first page, the ``objects`` section, the index ``make_index(objects_section)`` returns, the
    trailer; committed through fastio.Writer. ``before_commit()`` returning False discards the file
    (nothing appears at ``path``): returns None. Otherwise the file's size. ``pieces``: the payload
    as back-to-back views, each written when it is yielded (a copy still landing), instead of
    ``payload`` at once (whose length still sizes the file)."""
    with fastio.Writer(path, size_hint=PAYLOAD_OFFSET + len(payload) + len(objects) + 8192, engine=engine) as writer:
        writer.write(container.preamble_bytes(kind))
        writer.pad_to(PAGE)
        for piece in pieces if pieces is not None else (payload,):
            writer.write(piece)
        faults.point("full-write")
        objects_offset = writer.write(objects)
        index = container.encode_index(make_index(Section(objects_offset, len(objects),
                                                          fastio.crc32c(objects))).to_json())
        index_offset = writer.write(index)
        writer.write(container.trailer_bytes(index_offset, index, kind))
        if before_commit is not None and not before_commit():
            writer.abort()
            return None
        return writer.size


_ZERO_COPY = ("/model/", "/optimizer/")   # subtrees whose large tensors are handed out as views


def payload_tensor(payload: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype, shape, key: str):
    """The tensor ``key`` of a full checkpoint from its bytes ``payload[start:start + nbytes]`` (a
    uint8 read buffer). Large model and optimizer tensors stay views of the buffer (no copy). The
    rest is cloned: some torch entry points (set_rng_state, Generator.set_state) read a view with
    a storage offset from the start of its storage."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    view = payload[start:start + nbytes].view(dtype).view(shape)
    return view if nbytes >= PAGE and key.startswith(_ZERO_COPY) else view.clone()


def _checksum_matches(entry: Checksummed, data) -> bool:
    """``data`` against the entry's CRC-32C (or, in files written before it, zlib's CRC-32)."""
    if entry.crc32c is not None:
        return fastio.crc32c(data) == entry.crc32c
    return fastio.crc32(data) == entry.crc32


def read_full_index(path: str, *, engine=None) -> FullIndex:
    with fastio.Reader(path, engine=engine) as reader:
        return FullIndex.from_json(path, container.read_index(path, reader.read, reader.size, container.KIND_FULL),
                                   reader.size)


def hidden_parameters(model: torch.nn.Module, params, state: dict | None = None) -> dict:
    """{name: parameter} of ``params`` (an optimizer's) that ``model.state_dict()`` does not hand
    out under their own ``named_parameters()`` name: a state-dict hook put other tensors in their
    place (torchtitan's fused ``wqkv`` saved as ``wq``/``wk``/``wv``). A full checkpoint stores them
    under that name as well (docs/format.md, "Parameters the model's state_dict() does not hand
    out"): without them neither an export nor a replay has the parameter to start from.
    ``state``: ``model.state_dict(keep_vars=True)`` when the caller has it (hooks may gather)."""
    state = model.state_dict(keep_vars=True) if state is None else state
    shown = {id(v) for v in state.values()}
    wanted = {id(p) for p in params}
    return {name: p for name, p in model.named_parameters()
            if id(p) in wanted and id(p) not in shown and name not in state}


def live_targets(model: torch.nn.Module, optimizer, exclude=frozenset()) -> dict:
    """``load_full(into=...)`` for live objects: their tensors under the keys a full checkpoint
    stores them (its state is ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}``
    split by ``tree.split_tensors``). The model's parameters and buffers (``keep_vars=True`` hands
    out the live tensors, not detached views) except the names in ``exclude``, the parameters a
    state-dict hook hides (``hidden_parameters``), and the optimizer's state tensors when it has
    state (``state_dict()`` packs the live tensors, and ``load_state_dict`` adopts those the load
    returns)."""
    state = model.state_dict(keep_vars=True)
    live = {f"/model/{key}": value for key, value in state.items() if key not in exclude}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    live.update({f"/model/{name}": p for name, p in hidden_parameters(model, params, state).items()})
    live.update(tree.split_tensors(optimizer.state_dict()["state"], "/optimizer/state")[1])
    return live


def load_full(path: str, *, engine=None, verify: bool = True, into: dict | None = None,
              check=None, check_stripes: bool = False) -> tuple[FullIndex, FullState]:
    """Read a full checkpoint: (index, state). The payload is read with O_DIRECT in chunks queued
    together (``payloadread``); each tensor's checksum is verified as soon as its bytes have
    arrived, while later chunks are still being read, so verifying costs no time of its own.

    ``check_stripes``: of a striped checkpoint, also check every stripe file's CRC-32C (``verify``
    does; the tensors' checksums already cover every byte a resume uses).

    ``check(index, outline)``, if given, is called before the payload is read, with the state's
    outline (every tensor a ``meta`` tensor of its dtype and shape): it raises to refuse the file
    before anything is read into ``into``.

    ``into`` maps tensor keys (``"/model/<name>"``, ``"/optimizer/state/<index>/<name>"``: see
    ``live_targets``) to live tensors of the same dtype and shape (tensors sharing memory only
    partly are left out):
    their bytes are copied straight into them, and the state holds those very tensors (so
    ``load_state_dict`` finds them in place). If the payload turns out damaged, those tensors hold
    part of the checkpoint. The other large tensors are views of the read buffer (no copy): the
    optimizer adopts them as its state."""
    with fastio.Reader(path, engine=engine) as reader:
        index = FullIndex.from_json(path, container.read_index(path, reader.read, reader.size, container.KIND_FULL),
                                    reader.size)
        objects = reader.read(index.objects.offset, index.objects.nbytes)
        if not _checksum_matches(index.objects, objects):
            raise CorruptCheckpointError(path, f"objects section at offset {index.objects.offset} fails its "
                                               f"checksum")
        skeleton = tree.loads(objects, path)
        # A striped payload: its device directories and files are checked before anything is read.
        striped = StripedPayload(path, index.stripes, index.stripe_bytes, check_stripes) if index.stripes else None
        try:
            if check is not None:
                outline = {e.key: torch.empty(e.shape, dtype=dtype_from_name(e.dtype, path), device="meta")
                           for e in index.tensors}
                check(index, _state(path, index, skeleton, outline))
            buffer, placed = read_payload(path, striped or reader, index.payload_bytes, index.tensors, verify,
                                          into or {})
            if striped is not None and check_stripes:
                striped.check()
        finally:
            if striped is not None:
                striped.close()
    staging = buffer.tensor() if index.payload_bytes else torch.empty(0, dtype=torch.uint8)
    tensors = {}
    for entry in index.tensors:
        tensors[entry.key] = placed[entry.key] if entry.key in placed else payload_tensor(
            staging, entry.offset - PAYLOAD_OFFSET, entry.nbytes, dtype_from_name(entry.dtype, path), entry.shape,
            entry.key)
    return index, _state(path, index, skeleton, tensors)


def _state(path: str, index: FullIndex, skeleton, tensors: dict) -> FullState:
    def lookup(key):
        if key not in tensors:
            raise CorruptCheckpointError(path, f"index has no tensor {key!r}")
        return tensors[key]
    return FullState.from_tree(path, tree.join_tensors(skeleton, lookup))
