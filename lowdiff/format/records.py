"""Step records and differential batch files (layout in docs/format.md).

A record is everything needed to redo one step: the gradient the optimizer consumed (sparse or
dense), the hyper-parameters, and the state captured at the iteration boundary. Its structured part
(metadata, small objects, delta-encoded indices) is zstd-compressed; gradient values, which zstd
barely shrinks, are stored raw. Every record carries its own CRC32, so a damaged record ends the
usable prefix of a batch instead of poisoning the whole file.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import struct
import threading

import numpy as np
import torch
import zstandard

import fastio
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import tree
from lowdiff.format._deltas import decode_deltas_many, encode_deltas
from lowdiff.format.schema import FORMAT_VERSION, _Fields

RECORD_MAGIC = b"LDRC"
RECORD_HEADER = struct.Struct("<4sHHQIQI")  # magic, version, flags, step, packed bytes, raw bytes, crc32
_LEN = struct.Struct("<I")
ZSTD_LEVEL = 1


@dataclasses.dataclass(frozen=True)
class Compressed:
    """One parameter's gradient as recorded: dense values, or unique flat indices + values.

    Records on disk always hold sparse indices sorted ascending (as int32, delta-encoded). A
    compressor may hand over unsorted ones (``sorted=False``): the record encoder sorts them, with
    their values, off the training thread.
    """

    kind: str                      # "dense" | "sparse" | "none" (parameter had no gradient)
    numel: int
    values: torch.Tensor | None    # dense: the whole flat gradient; sparse: the kept values
    indices: torch.Tensor | None = None  # sparse only: int32 or int64, unique, values[i] belongs at indices[i]
    sorted: bool = True            # sparse only: indices ascending


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """Step ``step`` (1-based: the state after it is 'step completed steps')."""

    step: int
    skipped: bool
    grads: list            # list[Compressed], one per optimizer parameter in param_groups order
    objects: dict          # hyper-parameters, RNG, scheduler, extra_state, buffers (small)
    # Not part of the record's bytes: when set, the gradients' tensors are still being copied (from
    # a GPU, lowdiff.capture.devicecopy) and ready() blocks until they may be read.
    ready: object = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class GradMeta:
    """How one parameter's gradient is stored in a record: ``dense`` (``numel`` raw values),
    ``sparse`` (``nnz`` values and index deltas of ``width`` bytes) or ``none``."""

    kind: str
    numel: int
    nnz: int
    dtype: str
    width: int | None = None

    def to_json(self) -> list:
        out = [self.kind, self.numel, self.nnz, self.dtype]
        return out + [self.width] if self.kind == "sparse" else out

    @classmethod
    def from_json(cls, path: str, item, where: str) -> GradMeta:
        if not isinstance(item, list) or len(item) not in (4, 5):
            raise CorruptCheckpointError(path, f"{where}: gradient entry {item!r} is not "
                                               f"[kind, numel, nnz, dtype, width?]")
        kind, numel, nnz, dtype, *rest = item
        width = rest[0] if rest else (4 if kind == "sparse" else None)  # u32 deltas before widths existed
        ok = kind in ("dense", "sparse", "none") and all(isinstance(v, int) and v >= 0 for v in (numel, nnz)) \
            and isinstance(dtype, str) and (kind != "sparse" or (width in (2, 4) and nnz <= numel))
        if not ok:
            raise CorruptCheckpointError(path, f"{where}: gradient entry {item!r} is not valid")
        return cls(kind, numel, nnz, dtype, width)


@dataclasses.dataclass(frozen=True)
class RecordMeta:
    """The metadata at the start of a record's compressed part."""

    step: int
    skipped: bool
    objects_bytes: int
    grads: tuple              # GradMeta, one per optimizer parameter in param_groups order

    def to_json(self) -> dict:
        return {"step": self.step, "skipped": self.skipped, "objects_bytes": self.objects_bytes,
                "grads": [g.to_json() for g in self.grads]}

    @classmethod
    def from_json(cls, path: str, obj, where: str) -> RecordMeta:
        fields = _Fields(path, obj, f"{where} metadata")
        skipped = fields.get("skipped", bool)
        grads = tuple(GradMeta.from_json(path, g, where) for g in fields.get("grads", list))
        return cls(fields.count("step"), skipped, fields.count("objects_bytes"), grads)


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_DTYPE_NAMES: dict = {}


def dtype_from_name(name: str, path: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(path, f"unknown dtype {name!r}")
    return dtype


def _on_cpu(tensors: list) -> torch.Tensor:
    """The 1-D tensors back to back, on the CPU (one concatenation, one device transfer; none
    when they already lie back to back)."""
    joined = tree.joined(tensors)
    return joined if joined.device.type == "cpu" else joined.cpu()


def _sorted_sparse(sparse: list) -> tuple[np.ndarray, list]:
    """Every sparse gradient's indices sorted ascending, back to back (int64), and its values in
    the same order, one tensor per gradient. Gradients handed over unsorted are sorted all at
    once: each tensor's indices are offset past the previous tensors', so one sort orders every
    tensor and keeps them apart."""
    indices = _on_cpu([g.indices for g in sparse]).to(torch.int64)
    values = [g.values for g in sparse]
    if all(g.sorted for g in sparse):
        return indices.numpy(), values
    counts = [g.indices.numel() for g in sparse]
    offsets = np.repeat(np.cumsum([0] + [g.numel for g in sparse[:-1]], dtype=np.int64), counts)
    keys = indices.numpy() + offsets
    if sum(g.numel for g in sparse) <= _I32_MAX:
        sorted_keys, order = _sorted_small_keys(keys)
    else:
        sorted_keys, order = torch.sort(torch.from_numpy(keys))
    if all(v.dtype == values[0].dtype for v in values):
        values = list(torch.split(_on_cpu(values).index_select(0, order), counts))  # one gather for all
    else:  # the order stays within each tensor's segment: gather tensor by tensor
        first = 0
        for i, (part, count) in enumerate(zip(torch.split(order, counts), counts)):
            values[i] = values[i].cpu()[part - first]
            first += count
    return sorted_keys.numpy() - offsets, values


def _sorted_small_keys(keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort`` of distinct keys below 2**31 (sorted keys and the order), faster: each key
    and its position packed into one int64 (key in the high half), sorted by numpy's vectorized
    sort without the GIL, then split. The keys are distinct, so the order is the only one there is.
    On one core torch.sort took 1.1 ms for 26,000 int32 keys (one FSDP2 rank's TopK record of the
    quick model) and this 0.09 ms; 5M keys: 132 against 62 ms."""
    packed = np.sort((keys.astype(np.int64) << 32) | np.arange(keys.size, dtype=np.int64))
    return torch.from_numpy(packed >> 32), torch.from_numpy(packed & 0xFFFFFFFF)


def _delta_bytes(flat: np.ndarray | None, counts: list) -> tuple[bytes | bytearray | memoryview, list]:
    """Index deltas of sorted indices ``flat`` (``counts[i]`` of them per tensor, each tensor
    restarting from 0; None when there are no sparse tensors), and each tensor's delta width in
    bytes: 2 when all its deltas fit in u16 (the common case at TopK ratios), else 4. Narrow deltas
    are half the bytes for zstd to read and compress better. One pass in C without the GIL (lowdiff.format._deltas)."""
    if not counts:
        return b"", []
    assert flat is not None  # counts has an entry per sparse tensor
    return encode_deltas(np.ascontiguousarray(flat, dtype=np.int64), counts)


_I32_MAX = 2**31 - 1


def _values_bytes(values: list) -> list:
    """The gradient values back to back, as few buffers as possible (one when dtypes agree)."""
    values = [v for v in values if v.numel()]
    if not values:
        return []
    if all(v.dtype == values[0].dtype for v in values):
        return [tree.tensor_bytes(_on_cpu(values))]
    return [tree.tensor_bytes(v.reshape(-1).cpu()) for v in values]


def encode_record(record: StepRecord, compressor=None) -> list:
    """The record as a list of buffers to append to a batch file (header first).

    Per-tensor work is batched (one concatenation of indices and of values) because this runs in
    a background thread whose Python time competes with the training thread for the GIL.
    """
    present = [g for g in record.grads if g.kind != "none"]
    sparse = [g for g in present if g.kind == "sparse"]
    indices, sparse_values = _sorted_sparse(sparse) if sparse else (None, [])
    deltas, widths = _delta_bytes(indices, [g.values.numel() for g in sparse])
    width_of = dict(zip(map(id, sparse), widths))
    value_of = dict(zip(map(id, sparse), sparse_values))
    grads_meta = tuple(
        GradMeta("none", g.numel, 0, "") if g.kind == "none" else
        GradMeta("dense", g.numel, 0, dtype_name(g.values.dtype)) if g.kind == "dense" else
        GradMeta("sparse", g.numel, g.values.numel(), dtype_name(g.values.dtype), width_of[id(g)])
        for g in record.grads)
    raw = _values_bytes([value_of[id(g)] if g.kind == "sparse" else g.values for g in present])
    objects = tree.dumps(record.objects)
    meta = json.dumps(RecordMeta(record.step, record.skipped, len(objects), grads_meta).to_json(),
                      separators=(",", ":")).encode()
    structured = b"".join([_LEN.pack(len(meta)), meta, objects, deltas])
    packed = (compressor or _compressor(len(structured))).compress(structured)
    raw_bytes = sum(view.nbytes for view in raw)
    crc = fastio.crc32(packed)
    for view in raw:
        crc = fastio.crc32(view, crc)
    header = RECORD_HEADER.pack(RECORD_MAGIC, FORMAT_VERSION, 0, record.step, len(packed), raw_bytes, crc)
    return [header, packed, *raw]


# Where a record's values start in its file: at a multiple of this, the reader decodes them in place
# (views of its read buffer, see _value_region) instead of moving them down by a few bytes first,
# which for a dense record is a pass over model-sized memory beside the optimizer's step.
VALUES_ALIGN = 8
_SKIPPABLE = struct.Struct("<II")   # a zstd skippable frame's magic and the length of what follows
_SKIPPABLE_MAGIC = 0x184D2A50


def placed_at(offset: int, buffers: list) -> list:
    """The encoded record ``buffers`` (header, packed, values...) as they are written at file
    offset ``offset``: when the values would not start at a multiple of VALUES_ALIGN there, a zstd
    skippable frame of 9 to 15 bytes follows the packed part (zstd readers skip it; docs/format.md)
    and the header's packed length and CRC say so. The values are not read again: the CRC of the
    longer body comes from the old one by CRC linearity (fastio.crc32_shift)."""
    header, packed, *raw = buffers
    raw_bytes = sum(memoryview(v).nbytes for v in raw)
    misaligned = (offset + RECORD_HEADER.size + len(packed)) % VALUES_ALIGN
    if not raw_bytes or not misaligned:
        return buffers
    filler = VALUES_ALIGN - misaligned + VALUES_ALIGN - _SKIPPABLE.size   # a frame holds at least 8
    pad = _SKIPPABLE.pack(_SKIPPABLE_MAGIC, filler) + bytes(filler)
    magic, version, flags, step, packed_len, raw_len, crc = RECORD_HEADER.unpack(header)
    before = fastio.crc32(packed)
    crc ^= fastio.crc32_shift(fastio.crc32(pad, before) ^ before, raw_bytes)
    header = RECORD_HEADER.pack(magic, version, flags, step, packed_len + len(pad), raw_len, crc)
    return [header, packed, pad, *raw]


_local = threading.local()


# A structured part this large (the index deltas of millions of kept values: a 350M model at TopK 1%
# has 7 MB of them) is compressed by several zstd threads: on one core it took the writer about half
# a training step on an H100's host. Below it, one thread: the frames of small records stay as they
# were (the frames differ, the bytes they decompress to do not).
PARALLEL_ZSTD_BYTES = 4 << 20


def _zstd_threads() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return min(4, cores // 2)


def _compressor(nbytes: int = 0) -> zstandard.ZstdCompressor:
    """One zstd context per thread (a ZstdCompressor must not be shared between threads); a
    multi-threaded one for ``nbytes`` past PARALLEL_ZSTD_BYTES where the machine has the cores."""
    if nbytes >= PARALLEL_ZSTD_BYTES and _zstd_threads() >= 2:
        if not hasattr(_local, "zstd_parallel"):
            _local.zstd_parallel = zstandard.ZstdCompressor(level=ZSTD_LEVEL, threads=_zstd_threads())
        return _local.zstd_parallel
    if not hasattr(_local, "zstd"):
        _local.zstd = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return _local.zstd


def decode_record(data, path: str, offset: int, expected_step: int | None = None, *,
                  owned: bool = False) -> StepRecord:
    """Parse and verify one record from ``data`` (header + body). Raises CorruptCheckpointError.

    ``owned``: ``data`` is a writable buffer handed over for good (the caller neither reads nor
    reuses it while the record lives): the values are then views of it, not copies, and its bytes
    may be moved (see ``_value_region``). A dense record's values are the size of the model, and
    each copy of them into new memory costs about as much as reading them."""
    where = f"record at offset {offset}"
    view = memoryview(data)
    step, packed, raw = _verified_body(view, path, where, expected_step)
    try:
        structured = zstandard.ZstdDecompressor().decompress(packed)
    except zstandard.ZstdError as exc:
        raise CorruptCheckpointError(path, f"{where} cannot be decompressed: {exc}") from None
    (meta_len,) = _LEN.unpack_from(structured)
    try:
        meta = RecordMeta.from_json(path, json.loads(structured[4:4 + meta_len]), where)
    except ValueError as exc:
        raise CorruptCheckpointError(path, f"{where} has metadata that is not JSON: {exc}") from None
    pos = 4 + meta_len
    objects = tree.loads(structured[pos:pos + meta.objects_bytes], path)
    region = _value_region(view, RECORD_HEADER.size + packed.nbytes, raw.nbytes, owned)
    grads = _decode_grads(meta, structured, pos + meta.objects_bytes, region, path, where)
    return StepRecord(step, meta.skipped, grads, objects)


def _verified_body(view: memoryview, path: str, where: str, expected_step: int | None):
    """(step, packed part, raw part) of a record whose header and checksum verify."""
    if view.nbytes < RECORD_HEADER.size:
        raise CorruptCheckpointError(path, f"{where} is truncated")
    magic, version, flags, step, packed_len, raw_len, crc = RECORD_HEADER.unpack_from(view)
    if magic != RECORD_MAGIC:
        raise CorruptCheckpointError(path, f"{where} has bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        # The file's version was checked by its preamble and index; a record that disagrees with
        # its own file (its header is outside the CRC) is damage, not a newer format.
        raise CorruptCheckpointError(path, f"{where} says format version {version} inside a version "
                                           f"{FORMAT_VERSION} file")
    if flags:  # none are defined yet: a record that sets one needs a newer reader
        raise CorruptCheckpointError(path, f"{where} sets unknown flags 0x{flags:04x}")
    end = RECORD_HEADER.size + packed_len + raw_len
    if view.nbytes < end:
        raise CorruptCheckpointError(path, f"{where} is truncated ({view.nbytes} of {end} bytes)")
    body = view[RECORD_HEADER.size:end]
    if fastio.crc32(body) != crc:
        raise CorruptCheckpointError(path, f"{where} (step {step}) fails its checksum")
    if expected_step is not None and step != expected_step:
        raise CorruptCheckpointError(path, f"{where} holds step {step}, expected step {expected_step}")
    return step, body[:packed_len], body[packed_len:]


def _decode_grads(meta: RecordMeta, structured: bytes, pos: int, region: torch.Tensor, path: str, where: str) -> list:
    """The gradients ``meta`` describes: values from ``region`` (the value bytes, see
    ``_value_region``), index deltas from ``structured`` at ``pos``.

    A few calls for the whole record, not a few per gradient: the values are one view split, the
    indices one pass in C (``decode_deltas_many``). This runs on replay's decoding threads beside
    the thread that applies, and each torch or C call lets go of the GIL and must get it back: on
    a GPU machine, from a thread launching kernels all the time (a 350M record has ~300 tensors)."""
    raw_bytes = region.numel()
    raw_pos = 0
    placed: list = []   # per gradient: None (no gradient) or (its meta, dtype, value count, value byte offset)
    sparse = []
    for grad in meta.grads:
        if grad.kind == "none":
            placed.append(None)
            continue
        dtype = dtype_from_name(grad.dtype, path)
        count = grad.nnz if grad.kind == "sparse" else grad.numel
        if raw_pos + count * dtype.itemsize > raw_bytes:
            raise CorruptCheckpointError(path, f"{where} describes more value bytes than its {raw_bytes}")
        placed.append((grad, dtype, count, raw_pos))
        raw_pos += count * dtype.itemsize
        if grad.kind == "sparse":
            sparse.append(grad)
    if raw_pos != raw_bytes:
        raise CorruptCheckpointError(path, f"{where} declares {raw_bytes} value bytes but describes {raw_pos}")
    values = iter(_all_values(region, [p for p in placed if p is not None]))
    indices = iter(_all_indices(structured, pos, sparse, path, where))
    grads = []
    for grad, p in zip(meta.grads, placed):
        if p is None:
            grads.append(Compressed("none", grad.numel, None))
        elif grad.kind == "dense":
            grads.append(Compressed("dense", grad.numel, next(values)))
        else:
            grads.append(Compressed("sparse", grad.numel, next(values), next(indices)))
    return grads


def _all_values(region: torch.Tensor, placed: list) -> list:
    """Each gradient's values, views of ``region``: one view split when they share a dtype (the
    usual record), else one at a time (``_values``)."""
    if not placed:
        return []
    dtype = placed[0][1]
    if any(p[1] != dtype for p in placed):
        return [_values(region, start, count * p_dtype.itemsize, p_dtype) for _, p_dtype, count, start in placed]
    counts = [count for _, _, count, _ in placed]
    return list(_values(region, 0, region.numel(), dtype).split(counts))


def _all_indices(structured: bytes, pos: int, sparse: list, path: str, where: str) -> list:
    """The sparse gradients' indices (int32 tensors), decoded from their deltas in one pass."""
    if not sparse:
        return []
    nnzs = np.fromiter((g.nnz for g in sparse), dtype=np.int64, count=len(sparse))
    widths = np.fromiter((g.width for g in sparse), dtype=np.int64, count=len(sparse))
    if pos + int(np.dot(nnzs, widths)) > len(structured):
        raise CorruptCheckpointError(path, f"{where} describes more index deltas than it holds")
    numels = np.fromiter((g.numel for g in sparse), dtype=np.int64, count=len(sparse))
    indices, bad = decode_deltas_many(structured, pos, nnzs, widths, numels)
    if indices is None:
        raise CorruptCheckpointError(path, f"{where} has indices that are not sorted, unique and < "
                                           f"{sparse[bad].numel}")
    return list(torch.from_numpy(indices).split(nnzs.tolist()))


def _value_region(view: memoryview, start: int, nbytes: int, owned: bool) -> torch.Tensor:
    """The record's value bytes ``view[start:start + nbytes]`` (verified) as one uint8 tensor at an
    8-aligned address, which every gradient's values are views of. Not ``owned``: one copy (new
    memory is aligned). ``owned``: the buffer itself; values that do not start 8-aligned there are
    moved down onto the end of the packed part before them (already decompressed, so no longer
    needed) instead of being copied into new memory."""
    if not nbytes:
        return torch.empty(0, dtype=torch.uint8)
    if owned and not view.readonly:
        address = fastio.buffer_address(view) + start
        shift = address % 8
        if shift <= start - RECORD_HEADER.size:   # the packed part before the values is that long
            if shift:
                ctypes.memmove(address - shift, address, nbytes)   # the ranges overlap: memmove
            # Its own tensor (storage) over exactly these bytes: views as other dtypes need their
            # offsets in it to be multiples of the element size.
            return torch.frombuffer(view[start - shift:start - shift + nbytes], dtype=torch.uint8)
    return torch.frombuffer(bytearray(view[start:start + nbytes]), dtype=torch.uint8)


def _values(region: torch.Tensor, start: int, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """``nbytes`` of ``region`` from ``start`` as ``dtype`` values: a view, or a copy where they do
    not start at a multiple of their size (a record mixing dtypes)."""
    if not nbytes:
        return torch.empty(0, dtype=dtype)
    piece = region[start:start + nbytes]
    if piece.storage_offset() % dtype.itemsize:   # the region starts 8-aligned: so is this then
        piece = piece.clone()
    return piece.view(dtype)


def record_length(header: bytes) -> tuple[int, int]:
    """(step, total record bytes) from a record header, without verifying the body."""
    _, _, _, step, packed_len, raw_len, _ = RECORD_HEADER.unpack_from(header)
    return step, RECORD_HEADER.size + packed_len + raw_len
