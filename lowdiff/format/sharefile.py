"""Share files of a partitioned directory (docs/format.md, "Partitioned directories"): the schema
of a full-checkpoint share (container kind 3) and of a differential share (kind 4), writing them and
reading them back with every checksum checked.

Which bytes and which parameters a share holds is decided by lowdiff.distributed.partition; this module only
knows the bytes.
"""
from __future__ import annotations

import dataclasses

import fastio
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import container
from lowdiff.format.batchfile import write_batch
from lowdiff.format.fullckpt import write_full_file
from lowdiff.format.payloadread import StripedPayload
from lowdiff.format.schema import (
    PAGE,
    PAYLOAD_OFFSET,
    BatchIndex,
    FullMeta,
    Section,
    TensorEntry,
    _check_disjoint,
    _Fields,
    check_chunk_entry,
    check_header,
    stripes_from_json,
)


def share_range(shared_bytes: int, index: int, count: int) -> tuple[int, int]:
    """Bytes [start, end) of a shared payload of ``shared_bytes`` (a page multiple) that share
    ``index`` of ``count`` holds: page-aligned, balanced within one page."""
    def bound(i: int) -> int:
        return shared_bytes if i >= count else (i * shared_bytes // count) // PAGE * PAGE
    return bound(index), bound(index + 1)


@dataclasses.dataclass(frozen=True)
class Piece:
    """A shared tensor's bytes [offset, offset + nbytes) of the shared payload held by one share."""
    key: str
    offset: int
    nbytes: int
    crc32c: int

    def to_json(self) -> dict:
        return {"key": self.key, "offset": self.offset, "nbytes": self.nbytes, "crc32c": self.crc32c}


@dataclasses.dataclass(frozen=True, init=False)
class FullShareIndex(FullMeta):
    """The index of a full-checkpoint share (``kind`` "full-share"): a full checkpoint's fields
    (FullMeta) and the share's."""

    index: int                 # this share's position in its set
    count: int                 # shares in the set
    shared_bytes: int          # size of the set's shared payload
    layout: tuple              # the shared tensors: dicts {key, dtype, shape, offset, nbytes}
    pieces: tuple              # Piece, in offset order
    own_bytes: int             # this rank's own region (after the share's bytes in the file); ``tensors``
                               # are this rank's own tensors, ``objects`` its state skeleton
    dtensors: dict             # {key: chunk entry} of DTensor chunks (sharded state; else empty): of ``tensors``
                               # or of ``elsewhere``
    elsewhere: dict            # {key: {"share": j, "dtype": name}}: chunks share j holds instead (HSDP)
    stripes: tuple             # Stripe: the files holding a striped share's body (empty: the body is in the file)
    stripe_bytes: int          # the unit of the striped layout (0: not striped)

    # The arguments keep the order of the index's fields that callers construct it with.
    def __init__(self, step: int, session: str, run: str | None, index: int, count: int, shared_bytes: int,
                 layout: tuple, pieces: tuple, own_bytes: int, tensors: tuple, objects: Section, param_names: tuple,
                 param_aliases: dict, optimizer_class: str, compressor: str, dtensors: dict | None = None,
                 elsewhere: dict | None = None, stripes: tuple = (), stripe_bytes: int = 0):
        super().__init__(step, session, run, tensors, objects, param_names, param_aliases, optimizer_class, compressor)
        for name, value in (("index", index), ("count", count), ("shared_bytes", shared_bytes), ("layout", layout),
                            ("pieces", pieces), ("own_bytes", own_bytes), ("dtensors", dict(dtensors or {})),
                            ("elsewhere", dict(elsewhere or {})), ("stripes", tuple(stripes)),
                            ("stripe_bytes", stripe_bytes if stripes else 0)):
            object.__setattr__(self, name, value)

    @property
    def start(self) -> int:
        return share_range(self.shared_bytes, self.index, self.count)[0]

    @property
    def end(self) -> int:
        return share_range(self.shared_bytes, self.index, self.count)[1]

    @property
    def body_bytes(self) -> int:
        """The share's bytes of the shared payload and its own region: what a striped share stripes."""
        return self.end - self.start + self.own_bytes

    def to_json(self) -> dict:
        return {**self.meta_json("full-share"),
                "share": {"index": self.index, "count": self.count, "start": self.start, "end": self.end},
                "shared_bytes": self.shared_bytes, "layout": [dict(e) for e in self.layout],
                "pieces": [p.to_json() for p in self.pieces], "own_bytes": self.own_bytes,
                # Only sharded (DTensor) state has chunk entries: other shares keep their bytes.
                **({"dtensors": dict(self.dtensors)} if self.dtensors else {}),
                # Only HSDP shares lack chunks that another rank of the replicate group holds.
                **({"elsewhere": {k: dict(v) for k, v in self.elsewhere.items()}} if self.elsewhere else {}),
                # Only a striped share names stripes (docs/format.md, "More drives than ranks").
                **({"stripes": [s.to_json() for s in self.stripes], "stripe_bytes": self.stripe_bytes}
                   if self.stripes else {})}

    @classmethod
    def from_json(cls, path: str, obj, file_bytes: int) -> FullShareIndex:
        fields = check_header(path, obj, "full-share")
        share = _Fields(path, fields.get("share", dict), "share")
        index, count, shared_bytes = share.count("index"), share.count("count"), fields.count("shared_bytes")
        if count < 1 or index >= count or shared_bytes % PAGE:
            raise fields.bad(f"share {index} of {count} of a {shared_bytes}-byte shared payload is not valid")
        start, end = share_range(shared_bytes, index, count)
        if (share.count("start"), share.count("end")) != (start, end):
            raise fields.bad(f"share range {obj['share']} is not [{start}, {end}) for share {index} of {count}")
        own_bytes = fields.count("own_bytes")
        own_start = PAYLOAD_OFFSET + end - start
        items = fields.get("stripes", list, [])
        unit = fields.count("stripe_bytes") if items else 0
        stripes = stripes_from_json(path, items, end - start + own_bytes, unit, fields)
        body_end = PAYLOAD_OFFSET if stripes else own_start + own_bytes   # a striped body is in its stripes
        if own_bytes % PAGE or body_end > file_bytes:
            raise fields.bad(f"own region of {own_bytes} bytes does not fit the file in whole pages")
        layout = tuple(_layout_entry(path, e, i) for i, e in enumerate(fields.get("layout", list)))
        pieces = _pieces(fields, layout, start, end)
        tensors = tuple(TensorEntry.from_json(path, t, i) for i, t in enumerate(fields.get("tensors", list)))
        _check_disjoint(fields, tensors, own_start, own_start + own_bytes)
        objects = Section.from_json(path, fields.get("objects", dict), "objects section")
        if objects.offset < body_end or objects.offset + objects.nbytes > file_bytes:
            raise fields.bad(f"objects section at offset {objects.offset} lies outside the file after the payload")
        step, session, run, names, aliases, optimizer_class, compressor = cls.meta_fields(
            fields, fields.get("param_names", list), fields.get("param_aliases", dict))
        chunks = fields.get("dtensors", dict) if "dtensors" in obj else {}
        elsewhere = _elsewhere_chunks(fields, obj, index, count)
        own_shapes = {t.key: list(t.shape) for t in tensors}
        for key, entry in chunks.items():
            if key not in own_shapes and key not in elsewhere:
                raise fields.bad(f"dtensors names {key!r}, which is not one of its own tensors (nor held elsewhere)")
            if key in own_shapes and key in elsewhere:
                raise fields.bad(f"{key!r} is one of its own tensors and held elsewhere too")
            chunks[key] = check_chunk_entry(fields, entry, repr(key))
            if key in own_shapes and chunks[key]["shape"] != own_shapes[key]:
                raise fields.bad(f"the chunk entry of {key!r} has shape {entry['shape']}, its tensor {own_shapes[key]}")
        if set(elsewhere) - set(chunks):
            raise fields.bad(f"elsewhere names {sorted(set(elsewhere) - set(chunks))[0]!r}, which has no chunk entry")
        return cls(step, session, run, index, count, shared_bytes, layout, pieces, own_bytes, tensors, objects,
                   names, aliases, optimizer_class, compressor, chunks, elsewhere, stripes, unit)


def _elsewhere_chunks(fields: _Fields, obj, index: int, count: int) -> dict:
    """A full share's ``elsewhere`` (docs/format.md, "2-D meshes"): {key: {"share", "dtype"}},
    each naming another share of the set."""
    out = {}
    for key, item in (fields.get("elsewhere", dict) if "elsewhere" in obj else {}).items():
        where = _Fields(fields.path, item, f"elsewhere entry {key!r}")
        share, dtype = where.count("share"), where.get("dtype", str)
        if share >= count or share == index:
            raise fields.bad(f"elsewhere entry {key!r} names share {share}, not another of the set's {count}")
        out[key] = {"share": share, "dtype": dtype}
    return out


def _layout_entry(path: str, obj, position: int) -> dict:
    fields = _Fields(path, obj, f"layout entry #{position}")
    shape = fields.get("shape", list)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise fields.bad(f"shape {shape!r} is not a list of sizes")
    return {"key": fields.get("key", str), "dtype": fields.get("dtype", str), "shape": list(shape),
            "offset": fields.count("offset"), "nbytes": fields.count("nbytes")}


def _pieces(fields: _Fields, layout: tuple, start: int, end: int) -> tuple:
    """The pieces, checked to be exactly every layout tensor's intersection with [start, end)."""
    pieces = []
    for i, item in enumerate(fields.get("pieces", list)):
        piece = _Fields(fields.path, item, f"piece #{i}")
        pieces.append(Piece(piece.get("key", str), piece.count("offset"), piece.count("nbytes"),
                            piece.count("crc32c")))
    expected = [(e["key"], max(e["offset"], start), min(e["offset"] + e["nbytes"], end) - max(e["offset"], start))
                for e in layout if e["nbytes"] and e["offset"] < end and e["offset"] + e["nbytes"] > start]
    if [(p.key, p.offset, p.nbytes) for p in pieces] != expected:
        raise fields.bad(f"its pieces do not cover the shared tensors in [{start}, {end}) exactly")
    return tuple(pieces)


def write_full_share(path: str, body, objects: bytes, make_index, *, engine=None, before_commit=None,
                     striped: bool = False) -> int | None:
    """Write a full-checkpoint share: ``body`` (the share's bytes then the own region, page
    multiples), ``objects``, and the index ``make_index(objects_section)`` returns; commit it.
    ``before_commit()`` returning False discards it: returns None. ``striped``: the body is in
    stripes already durable (named by the index), the file holds the rest."""
    return write_full_file(path, container.KIND_FULL_SHARE, memoryview(b"") if striped else body, objects,
                           make_index, engine=engine, before_commit=before_commit)


class ShareBody:
    """The body of a full-checkpoint share as one reader of logical file offsets (the body at
    PAYLOAD_OFFSET, as the index gives them): the file's own reader, or for a striped share its
    stripes (lowdiff.format.payloadread.StripedPayload: a missing drive raises MissingDeviceError, a
    missing or resized stripe file CorruptCheckpointError naming it, when this is made)."""

    def __init__(self, path: str, reader, index: FullShareIndex, check_stripes: bool = False) -> None:
        self.striped = StripedPayload(path, index.stripes, index.stripe_bytes, check_stripes) \
            if index.stripes else None
        self._reader = reader

    def submit_read_into(self, offset: int, out):
        return (self.striped or self._reader).submit_read_into(offset, out)

    def read_into(self, offset: int, out) -> None:
        self.submit_read_into(offset, out)()

    def read(self, offset: int, nbytes: int) -> bytes:
        if self.striped is None:
            return self._reader.read(offset, nbytes)
        out = bytearray(nbytes)
        if nbytes:
            self.read_into(offset, out)
        return bytes(out)

    def check(self) -> None:
        """A striped body read whole with ``check_stripes``: every stripe file's CRC-32C."""
        if self.striped is not None:
            self.striped.check()

    def close(self) -> None:
        if self.striped is not None:
            self.striped.close()

    def __enter__(self) -> ShareBody:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_full_share_index(path: str, reader) -> FullShareIndex:
    raw = container.read_index(path, reader.read, reader.size, container.KIND_FULL_SHARE)
    return FullShareIndex.from_json(path, raw, reader.size)


def read_share_bytes_into(path: str, reader, index: FullShareIndex, out) -> None:
    """Read the share's bytes of the shared payload into ``out`` (a writable buffer of
    ``end - start`` bytes) and check every piece's CRC-32C. ``reader``: the file's, or its ShareBody."""
    if index.end > index.start:
        with ShareBody(path, reader, index) if index.stripes and not isinstance(reader, ShareBody) else \
                _Borrowed(reader) as body:
            body.read_into(PAYLOAD_OFFSET, out)
    view = memoryview(out)
    for piece in index.pieces:
        lo = piece.offset - index.start
        if fastio.crc32c(view[lo:lo + piece.nbytes]) != piece.crc32c:
            raise CorruptCheckpointError(path, f"shared tensor {piece.key!r} bytes {piece.offset}.."
                                               f"{piece.offset + piece.nbytes} fail their checksum")


class _Borrowed:
    """A reader used as a context manager without closing it (the caller's)."""

    def __init__(self, reader) -> None:
        self.reader = reader

    def __enter__(self):
        return self.reader

    def __exit__(self, *exc: object) -> None:
        pass


def read_own(path: str, reader, index: FullShareIndex) -> tuple[dict, bytes]:
    """(own tensors by key as raw bytes, objects section bytes), every checksum checked. ``reader``:
    the share file's (a striped share's own tensors are read from its stripes)."""
    own = {}
    with ShareBody(path, reader, index) if index.stripes and any(e.nbytes for e in index.tensors) else \
            _Borrowed(reader) as body:
        for entry in index.tensors:
            data = body.read(entry.offset, entry.nbytes) if entry.nbytes else b""
            if fastio.crc32c(data) != entry.crc32c:
                raise CorruptCheckpointError(path, f"tensor {entry.key!r} at offset {entry.offset} fails its "
                                                   f"checksum")
            own[entry.key] = (entry, bytearray(data))
    objects = reader.read(index.objects.offset, index.objects.nbytes)
    if fastio.crc32c(objects) != index.objects.crc32c:
        raise CorruptCheckpointError(path, f"objects section at offset {index.objects.offset} fails its checksum")
    return own, objects


# ---------------------------------------------------------------- differential shares
@dataclasses.dataclass(frozen=True)
class DiffShareIndex:
    """The index of a differential share: a batch index plus the share and the slots it owns."""

    batch: BatchIndex
    index: int
    count: int
    slots: tuple
    dtensors: dict = dataclasses.field(default_factory=dict)   # {slot: chunk entry}: every share's DTensor slots
    elsewhere: dict = dataclasses.field(default_factory=dict)  # {slot of dtensors: share recording it instead}

    @classmethod
    def from_json(cls, path: str, obj, records_end: int) -> DiffShareIndex:
        fields = check_header(path, obj, "diff-share")
        share = _Fields(path, fields.get("share", dict), "share")
        index, count = share.count("index"), share.count("count")
        slots = fields.get("slots", list)
        if count < 1 or index >= count or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in slots):
            raise fields.bad(f"share {index} of {count} owning slots {slots!r} is not valid")
        elsewhere = {}
        for item in fields.get("elsewhere", list) if "elsewhere" in obj else []:
            if not (isinstance(item, list) and len(item) == 2 and all(isinstance(n, int) and not isinstance(n, bool)
                                                                      for n in item)
                    and item[0] not in slots and item[0] not in elsewhere and 0 <= item[1] < count
                    and item[1] != index):
                raise fields.bad(f"elsewhere entry {item!r} is not [slot not of this share, another share]")
            elsewhere[item[0]] = item[1]
        chunks = {}
        for item in fields.get("dtensors", list) if "dtensors" in obj else []:
            if not (isinstance(item, list) and len(item) == 2 and (item[0] in slots or item[0] in elsewhere)):
                raise fields.bad(f"dtensors entry {item!r} is not [slot of this share, chunk entry]")
            chunks[item[0]] = check_chunk_entry(fields, item[1], f"parameter {item[0]}")
        if set(elsewhere) - set(chunks):
            raise fields.bad(f"elsewhere names parameter {sorted(set(elsewhere) - set(chunks))[0]}, which has no "
                             f"chunk entry")
        batch = BatchIndex.from_json(path, {**obj, "kind": "diff"}, records_end)
        return cls(batch, index, count, tuple(slots), chunks, elsewhere)

    @staticmethod
    def share_json(index: int, count: int, slots, dtensors: dict | None = None, elsewhere: dict | None = None) -> dict:
        """What a differential share's index adds to a batch's (its ``kind`` replaces "diff")."""
        chunks = {"dtensors": [[slot, entry] for slot, entry in sorted(dtensors.items())]} if dtensors else {}
        held = {"elsewhere": [[slot, share] for slot, share in sorted(elsewhere.items())]} if elsewhere else {}
        return {"kind": "diff-share", "share": {"index": index, "count": count}, "slots": list(slots), **chunks,
                **held}


def write_diff_share(path: str, session: str, records: list, *, run: str | None, share: tuple[int, int],
                     slots: list, engine=None, dtensors: dict | None = None, elsewhere: dict | None = None) -> int:
    """Write ``records`` ([(step, [buffers])], consecutive steps, already restricted to ``slots``)
    as share ``share`` = (index, count) and commit it. ``dtensors``: {slot: chunk entry} of the
    DTensor slots (their records hold this rank's local gradient chunk, unless ``elsewhere``:
    {slot: share} says which other share records that same chunk). Returns the file's size."""
    return write_batch(path, session, records, run=run, engine=engine, kind=container.KIND_DIFF_SHARE,
                       index_fields=DiffShareIndex.share_json(share[0], share[1], slots, dtensors, elsewhere))


def read_diff_share_index(path: str, reader=None) -> DiffShareIndex:
    """The index of the differential share at ``path`` (read from the file, or through ``reader``:
    ``read(offset, n)`` and ``size`` of its bytes elsewhere; records not checked)."""
    if reader is None:
        with fastio.Reader(path) as reader:
            return read_diff_share_index(path, reader)
    raw = container.read_index(path, reader.read, reader.size, container.KIND_DIFF_SHARE)
    return DiffShareIndex.from_json(path, raw, reader.size - container.TRAILER.size)


def read_share_index(path: str):
    """The index of a share file of either kind, by the kind its preamble names: FullShareIndex,
    or the BatchIndex of a differential share. Raises like the readers of each kind."""
    if container.file_kind(path) == container.KIND_FULL_SHARE:
        with fastio.Reader(path) as reader:
            return read_full_share_index(path, reader)
    return read_diff_share_index(path).batch


def parse_diff_share(path: str, data) -> DiffShareIndex:
    """The index of a differential share held in memory (``data``: the whole file)."""
    view = memoryview(data)
    raw = container.read_index(path, lambda offset, n: bytes(view[offset:offset + n]), len(view),
                               container.KIND_DIFF_SHARE)
    return DiffShareIndex.from_json(path, raw, len(view) - container.TRAILER.size)
