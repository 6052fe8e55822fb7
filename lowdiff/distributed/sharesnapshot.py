"""One rank's share of a full checkpoint, held in staging memory: the rank's byte range of the
shared payload (parameters and optimizer state, the same on every rank) followed by its own region
(buffers, RNG, residuals), persisted as a full-checkpoint share (lowdiff.format.sharefile).

It is a ``fullckpt.Snapshot`` with the same call order (stage on the training thread, copy here or
on the persist thread, persist) and the same staging-buffer reuse; only the bytes copied differ:
each rank copies and writes about 1/W of the shared state.
"""
from __future__ import annotations

import torch

import fastio
from lowdiff.distributed.dtensors import assign_holders, chunk_entry, is_dtensor, local_chunk, replica_group
from lowdiff.format import tree
from lowdiff.format.fullckpt import Snapshot, _version_counters, plan_layout
from lowdiff.format.records import dtype_name
from lowdiff.format.schema import PAGE, PAYLOAD_OFFSET, TensorEntry
from lowdiff.format.sharefile import FullShareIndex, Piece, share_range, write_full_share


def is_shared_key(key: str, param_aliases: dict) -> bool:
    """Whether a full checkpoint's tensor ``key`` is the same on every rank: a parameter or
    optimizer state. Buffers, RNG, residuals and extra_state are each rank's own."""
    if key.startswith("/optimizer/state/"):
        return True
    return key.startswith("/model/") and key[len("/model/"):] in param_aliases


class ShareSnapshot(Snapshot):
    supports_device_copy = False   # a share's device tensors are brought to the host on the training thread

    def __init__(self, index: int, count: int):
        super().__init__()
        self.index, self.count = index, count
        self._plan: tuple | None = None   # (layout, shared_bytes, pieces, own entries, own_bytes)
        self._crcs: list = []
        self._body_bytes = 0
        self._chunks: dict = {}   # {key: chunk entry} of the DTensors staged (their local chunks are own)
        self._elsewhere: dict = {}   # {key: {"share", "dtype"}}: chunks another rank of the replicate group writes

    def stage(self, step: int, state: dict, meta) -> None:
        """As Snapshot.stage; a DTensor is staged as this rank's local chunk (an own tensor, with its
        chunk entry): under FSDP2 no rank holds another's chunk (docs/format.md, "Sharded state").
        Under HSDP the ranks of a replicate group hold the same chunks: each is staged by the one
        rank of the group that writes it, and named ``elsewhere`` by the others ("2-D meshes")."""
        super().stage(step, state, meta)
        tensors, _ = self._staged
        dtensor_items = [(key, t) for key, t in tensors if is_dtensor(t)]
        self._chunks = {key: chunk_entry(t) for key, t in dtensor_items}
        holders = assign_holders([(key, replica_group(t), local_chunk(t).nbytes) for key, t in dtensor_items])
        self._elsewhere = {key: {"share": holders[key], "dtype": dtype_name(t.dtype)} for key, t in dtensor_items
                           if holders[key] != self.index}
        if self._chunks:
            local = [(key, local_chunk(t)) for key, t in tensors if key not in self._elsewhere]
            self._staged = (local, _version_counters(t for _, t in local))

    def copy(self, on_training_thread: bool) -> None:
        """Copy this share's bytes of the shared tensors and this rank's own tensors into staging,
        each piece's CRC-32C computed in the same pass (one GIL-free call)."""
        tensors, _ = self._staged
        assert self.meta is not None, "stage() records what the checkpoint was trained with"
        aliases = self.meta.param_aliases
        # Device or non-contiguous tensors are brought to contiguous host memory first (on the
        # training thread: copyable_in_background() refuses them).
        sources = {key: t if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()
                   else t.detach().cpu().contiguous().resolve_conj().resolve_neg() for key, t in tensors}
        shared = {k for k, _ in tensors if is_shared_key(k, aliases) and k not in self._chunks}
        layout, shared_bytes = plan_layout([(k, t) for k, t in tensors if k in shared])
        own, own_bytes = plan_layout([(k, t) for k, t in tensors if k not in shared])
        start, end = share_range(shared_bytes, self.index, self.count)
        body_bytes = end - start + own_bytes
        self._ensure_buffer(body_bytes)
        assert self._buffer is not None
        base = self._buffer.tensor(max(body_bytes, 1)).data_ptr()
        pieces, dsts, srcs = [], [], []
        for e in layout:
            lo, hi = max(e.offset, start), min(e.offset + e.nbytes, end)
            if hi > lo:
                pieces.append((e.key, lo, hi - lo))
                dsts.append(base + lo - start)
                srcs.append(sources[e.key].data_ptr() + lo - e.offset)
        for e in own:
            if e.nbytes:
                dsts.append(base + end - start + e.offset)
                srcs.append(sources[e.key].data_ptr())
        sizes = [n for _, _, n in pieces] + [e.nbytes for e in own if e.nbytes]
        with torch.no_grad():
            crcs = fastio.copy_regions(dsts, srcs, sizes, checksums=True) if sizes else []
        self._crcs = list(crcs)
        self._plan = (layout, shared_bytes, pieces, own, own_bytes)
        self._body_bytes = body_bytes
        self.payload_bytes = body_bytes

    def _ensure_buffer(self, nbytes: int) -> None:
        if self._buffer is not None and self._buffer.capacity_bytes >= nbytes:
            return
        spare, self.spare = self.spare, None
        self._buffer = spare if spare is not None and spare.capacity_bytes >= nbytes else \
            fastio.aligned_buffer(max(nbytes, PAGE), populate=True)

    def prepare(self, payload_bytes: int) -> None:
        """Pre-fault staging for about this rank's share of a ``payload_bytes`` state."""
        super().prepare(payload_bytes // self.count + (1 << 20))

    def persist(self, path: str, session: str, *, run: str | None = None, engine=None,
                before_commit=None, stripe=None) -> int | None:
        """Write and commit the share (see Snapshot.persist). ``stripe``: as there, for the share's
        body (its bytes of the shared payload, then its own region: docs/format.md, "More drives
        than ranks"); the file then holds the preamble, objects, index and trailer."""
        assert self._plan is not None and self._buffer is not None, "copy() before persist()"
        body = self._buffer.view(0, self._body_bytes)
        stripes: tuple = ()
        unit = 0
        if stripe is not None and self._body_bytes:
            unit, stripes = stripe(body)   # (if before_commit refuses, the caller removes them)
        else:
            self.register_fixed(engine)
        layout, shared_bytes, pieces, own, own_bytes = self._plan
        start, end = share_range(shared_bytes, self.index, self.count)
        crcs = iter(self._crcs)
        piece_entries = tuple(Piece(key, lo, n, next(crcs)) for key, lo, n in pieces)
        own_entries = tuple(TensorEntry(PAYLOAD_OFFSET + end - start + e.offset, e.nbytes,
                                        next(crcs) if e.nbytes else fastio.crc32c(b""),
                                        key=e.key, dtype=e.dtype, shape=e.shape) for e in own)
        objects = tree.dumps(self._skeleton)
        meta = self.meta
        assert meta is not None, "stage() records what the checkpoint was trained with"
        layout_json = tuple({"key": e.key, "dtype": e.dtype, "shape": list(e.shape), "offset": e.offset,
                             "nbytes": e.nbytes} for e in layout)

        def make_index(objects_section):
            return FullShareIndex(self.step, session, run, self.index, self.count, shared_bytes, layout_json,
                                  piece_entries, own_bytes, own_entries, objects_section, *meta.fields(),
                                  dtensors=self._chunks, elsewhere=self._elsewhere, stripes=stripes,
                                  stripe_bytes=unit)
        return write_full_share(path, body, objects, make_index, engine=engine, before_commit=before_commit,
                                striped=bool(stripes))
