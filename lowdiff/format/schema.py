"""The on-disk schema, in one place: what a full checkpoint's index, a differential batch's index,
a share's index, the captured per-step state, the manifest and the two JSON sidecars
(CONTROLLER.json, TIERS.json) contain (docs/format.md); a record's own metadata is beside its
encoder (lowdiff.format.records).

Each is a frozen dataclass with ``to_json()`` (the JSON object written) and ``from_json(path,
obj)`` (parse and validate with checked arithmetic: every field present with the right type, sizes
and offsets inside the file, tensors inside the payload region and not overlapping). A reader
never indexes raw JSON; a value that does not fit raises CorruptCheckpointError naming the file
and the field.
"""
from __future__ import annotations

import dataclasses
import math

from lowdiff.errors import CorruptCheckpointError, VersionMismatchError

FORMAT_VERSION = 1            # the binary files' preamble, trailer and index
PAGE = 4096
PAYLOAD_OFFSET = PAGE          # a full checkpoint's payload region starts on the first page
SMALL_TENSOR_ALIGN = 64        # tensors under a page are packed, aligned for any dtype
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
               "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


class _Fields:
    """Checked access to one JSON object of file ``path`` (``what`` names it in errors)."""

    def __init__(self, path: str, obj, what: str):
        if not isinstance(obj, dict):
            raise CorruptCheckpointError(path, f"{what} is not a JSON object")
        self.path, self.obj, self.what = path, obj, what

    def bad(self, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(self.path, f"{self.what}: {problem}")

    def get(self, key: str, kind, default=dataclasses.MISSING):
        if key not in self.obj:
            if default is not dataclasses.MISSING:
                return default
            raise self.bad(f"field {key!r} is missing")
        value = self.obj[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise self.bad(f"field {key!r} is {value!r}, not an integer")
        if kind is not int and not isinstance(value, kind):
            raise self.bad(f"field {key!r} is {value!r}, not {getattr(kind, '__name__', kind)}")
        return value

    def count(self, key: str, default=dataclasses.MISSING) -> int:
        value = self.get(key, int, default)
        if value is not None and value < 0:
            raise self.bad(f"field {key!r} is negative ({value})")
        return value


def check_chunk_entry(fields: _Fields, entry: object, where: str) -> dict:
    """A chunk entry of sharded (DTensor) state read from a file (docs/format.md, "Sharded state"),
    checked field by field; ``fields`` names the file in the error."""
    if not isinstance(entry, dict):
        raise fields.bad(f"chunk entry of {where} is not an object")
    sizes = ("global_shape", "mesh_shape", "offsets", "shape")
    if not all(isinstance(entry.get(k), list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                                      for n in entry[k]) for k in sizes):
        raise fields.bad(f"chunk entry of {where} needs lists of sizes {', '.join(sizes)}: {entry!r}")
    names = entry.get("mesh_dim_names")
    placements = entry.get("placements")
    if names is not None and not (isinstance(names, list) and len(names) == len(entry["mesh_shape"])
                                  and all(isinstance(n, str) for n in names)):
        raise fields.bad(f"chunk entry of {where}: mesh_dim_names {names!r} is not one name per mesh dimension")
    ndim = len(entry["global_shape"])
    if not (isinstance(placements, list) and len(placements) == len(entry["mesh_shape"])
            and all(p == "R" or (isinstance(p, str) and p[:1] == "S" and p[1:].isdigit() and int(p[1:]) < ndim)
                    for p in placements)):
        raise fields.bad(f"chunk entry of {where}: placements {placements!r} are not one 'R' or 'S<dim>' per mesh "
                         f"dimension")
    if len(entry["offsets"]) != ndim or len(entry["shape"]) != ndim or \
            any(o + n > g for o, n, g in zip(entry["offsets"], entry["shape"], entry["global_shape"])):
        raise fields.bad(f"chunk entry of {where}: a chunk of shape {entry['shape']} at {entry['offsets']} does not "
                         f"lie in a tensor of shape {entry['global_shape']}")
    return {k: entry[k] for k in ("global_shape", "mesh_shape", "mesh_dim_names", "placements", "offsets", "shape")}


def check_header(path: str, obj, kind: str) -> _Fields:
    """The common part of every index: ``version`` and ``kind``."""
    fields = _Fields(path, obj, f"{kind} index")
    version = fields.get("version", int)
    if version != FORMAT_VERSION:
        raise VersionMismatchError(path, f"index version {version!r}, this lowdiff reads version {FORMAT_VERSION}")
    if fields.get("kind", str) != kind:
        raise fields.bad(f"kind is {obj['kind']!r}, expected {kind!r}")
    return fields


@dataclasses.dataclass(frozen=True)
class Checksummed:
    """A byte range of a file and its checksum: CRC-32C, or zlib's CRC-32 in files written before
    CRC-32C (exactly one of the two is set)."""

    offset: int
    nbytes: int
    crc32c: int | None = None
    crc32: int | None = None

    def checksum_json(self) -> dict:
        return {"crc32c": self.crc32c} if self.crc32c is not None else {"crc32": self.crc32}

    @staticmethod
    def checksums(fields: _Fields) -> tuple[int | None, int | None]:
        crc32c, crc32 = fields.count("crc32c", None), fields.count("crc32", None)
        if crc32c is None and crc32 is None:
            raise fields.bad("it has no checksum (neither 'crc32c' nor 'crc32')")
        return crc32c, crc32


@dataclasses.dataclass(frozen=True)
class TensorEntry(Checksummed):
    key: str = ""
    dtype: str = "uint8"
    shape: tuple = ()

    def to_json(self) -> dict:
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset,
                "nbytes": self.nbytes, **self.checksum_json()}

    @classmethod
    def from_json(cls, path: str, obj, position: int) -> TensorEntry:
        fields = _Fields(path, obj, f"tensor entry #{position}")
        key, dtype = fields.get("key", str), fields.get("dtype", str)
        shape = fields.get("shape", list)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
            raise fields.bad(f"shape {shape!r} of {key!r} is not a list of sizes")
        nbytes = fields.count("nbytes")
        if dtype in DTYPE_BYTES and math.prod(shape) * DTYPE_BYTES[dtype] != nbytes:
            raise fields.bad(f"{key!r}: {nbytes} bytes do not hold a {dtype} tensor of shape {tuple(shape)}")
        return cls(fields.count("offset"), nbytes, *cls.checksums(fields), key=key, dtype=dtype, shape=tuple(shape))


@dataclasses.dataclass(frozen=True)
class Section(Checksummed):
    def to_json(self) -> dict:
        return {"offset": self.offset, "nbytes": self.nbytes, **self.checksum_json()}

    @classmethod
    def from_json(cls, path: str, obj, what: str) -> Section:
        fields = _Fields(path, obj, what)
        return cls(fields.count("offset"), fields.count("nbytes"), *cls.checksums(fields))


@dataclasses.dataclass(frozen=True)
class TrainedWith:
    """What a full checkpoint records of the objects it was taken from, built by the capture and
    written into the index (its fields are FullMeta's last four; docs/format.md)."""

    param_names: tuple        # model names of the optimizer's parameters, in param_groups order
    param_aliases: dict       # state-dict key -> parameter position (tied weights)
    optimizer_class: str      # import path of the optimizer class
    compressor: str           # repr of the compressor

    def fields(self) -> tuple:
        """(param_names, param_aliases, optimizer_class, compressor): the index constructors' order."""
        return tuple(self.param_names), self.param_aliases, self.optimizer_class, self.compressor


@dataclasses.dataclass(frozen=True)
class FullMeta:
    """What a full checkpoint's index and a full-checkpoint share's index both carry (declared
    once here; lowdiff.format.sharefile adds the share's fields)."""

    step: int
    session: str
    run: str | None
    tensors: tuple            # TensorEntry, offsets absolute in the file
    objects: Section          # the state skeleton ("small objects" encoding)
    param_names: tuple        # model names of the optimizer's parameters, in param_groups order
    param_aliases: dict       # state-dict key -> parameter position (tied weights)
    optimizer_class: str      # import path of the optimizer class
    compressor: str           # repr of the compressor

    def meta_json(self, kind: str) -> dict:
        return {"version": FORMAT_VERSION, "kind": kind, "step": self.step, "session": self.session,
                "run": self.run, "tensors": [t.to_json() for t in self.tensors], "objects": self.objects.to_json(),
                "param_names": list(self.param_names), "param_aliases": dict(self.param_aliases),
                "optimizer_class": self.optimizer_class, "compressor": self.compressor}

    @staticmethod
    def meta_fields(fields: _Fields, names: list, aliases: dict) -> tuple:
        """(step, session, run, param_names, param_aliases, optimizer_class, compressor) of an index."""
        return (fields.count("step"), fields.get("session", str), fields.get("run", (str, type(None)), None),
                tuple(names), aliases, fields.get("optimizer_class", str), fields.get("compressor", str))


@dataclasses.dataclass(frozen=True)
class Stripe:
    """The file of one device of a striped full checkpoint's payload (docs/format.md, "Striped full
    checkpoints"): ``file`` in the device directory ``dir`` (None: the checkpoint's own directory),
    ``nbytes`` long, its CRC-32C. Which payload bytes it holds follows from its position among the
    stripes and the index's ``stripe_bytes`` (``stripe_pieces``)."""

    dir: str | None
    file: str
    nbytes: int
    crc32c: int

    def to_json(self) -> dict:
        return {"dir": self.dir, "file": self.file, "nbytes": self.nbytes, "crc32c": self.crc32c}

    @classmethod
    def from_json(cls, path: str, obj, position: int) -> Stripe:
        fields = _Fields(path, obj, f"stripe #{position}")
        directory = fields.get("dir", (str, type(None)))
        name = fields.get("file", str)
        if "/" in name or name in ("", ".", "..") or (directory is not None and not directory.startswith("/")):
            raise fields.bad(f"stripe file {name!r} in {directory!r} is not a plain name in an absolute directory")
        return cls(directory, name, fields.count("nbytes"), fields.count("crc32c"))


def stripe_sizes(payload_bytes: int, unit: int, count: int) -> list[int]:
    """The size of each of ``count`` stripe files of a payload laid out in units of ``unit`` bytes,
    unit ``i`` on device ``i mod count`` (the last unit may be shorter)."""
    units, tail = divmod(payload_bytes, unit)
    sizes = [(units // count + (1 if k < units % count else 0)) * unit for k in range(count)]
    if tail:
        sizes[units % count] += tail
    return sizes


def stripe_pieces(unit: int, count: int, low: int, high: int) -> list[tuple[int, int, int, int]]:
    """``[(device, offset in its stripe file, payload offset, nbytes)]``: where the payload bytes
    ``[low, high)`` are (unit ``i`` = payload bytes ``[i * unit, (i + 1) * unit)`` is the
    ``i // count``-th unit of device ``i mod count``'s file)."""
    out, position = [], low
    while position < high:
        number, within = divmod(position, unit)
        nbytes = min(unit - within, high - position)
        out.append((number % count, (number // count) * unit + within, position, nbytes))
        position += nbytes
    return out


def stripes_from_json(path: str, items, payload_bytes: int, unit: int, what: _Fields) -> tuple:
    """The stripes of a list read from ``path``, checked against the layout of ``payload_bytes``
    in units of ``unit``: one stripe per device, each of the size the layout gives it."""
    stripes = tuple(Stripe.from_json(path, item, i) for i, item in enumerate(items))
    if not stripes:
        return stripes
    if unit <= 0 or unit % PAGE or len(stripes) > -(-payload_bytes // unit):
        raise what.bad(f"{len(stripes)} stripes in units of {unit} bytes do not lay out a payload of "
                       f"{payload_bytes} bytes (whole pages, every stripe holding a unit)")
    sizes = stripe_sizes(payload_bytes, unit, len(stripes))
    for position, (stripe, size) in enumerate(zip(stripes, sizes)):
        if stripe.nbytes != size:
            raise what.bad(f"stripe #{position} is {stripe.nbytes} bytes, the layout gives it {size}")
    return stripes


@dataclasses.dataclass(frozen=True, init=False)
class FullIndex(FullMeta):
    """The index of a full checkpoint (docs/format.md, "Full checkpoint"). ``stripes`` (empty: the
    payload is in the file itself) are the files holding a striped checkpoint's payload."""

    payload_bytes: int
    stripes: tuple = ()
    stripe_bytes: int = 0     # the unit of the striped layout (0: not striped)

    # The arguments keep the order of the index's fields that callers construct it with.
    def __init__(self, step: int, session: str, run: str | None, payload_bytes: int, tensors: tuple,
                 objects: Section, param_names: tuple, param_aliases: dict, optimizer_class: str, compressor: str,
                 stripes: tuple = (), stripe_bytes: int = 0):
        super().__init__(step, session, run, tensors, objects, param_names, param_aliases, optimizer_class, compressor)
        object.__setattr__(self, "payload_bytes", payload_bytes)
        object.__setattr__(self, "stripes", tuple(stripes))
        object.__setattr__(self, "stripe_bytes", stripe_bytes if stripes else 0)

    def to_json(self) -> dict:
        out = {**self.meta_json("full"), "payload_bytes": self.payload_bytes}
        if self.stripes:   # absent in a checkpoint that is not striped: its bytes stay as before
            out["stripes"] = [s.to_json() for s in self.stripes]
            out["stripe_bytes"] = self.stripe_bytes
        return out

    @classmethod
    def from_json(cls, path: str, obj, file_bytes: int) -> FullIndex:
        fields = check_header(path, obj, "full")
        payload_bytes = fields.count("payload_bytes")
        items = fields.get("stripes", list, [])
        unit = fields.count("stripe_bytes") if items else 0
        stripes = stripes_from_json(path, items, payload_bytes, unit, fields)
        in_file = 0 if stripes else payload_bytes   # a striped payload is in its stripes, not here
        if payload_bytes % PAGE or PAYLOAD_OFFSET + in_file > file_bytes:
            raise fields.bad(f"payload of {payload_bytes} bytes does not fit a {file_bytes}-byte file in whole pages")
        tensors = tuple(TensorEntry.from_json(path, t, i) for i, t in enumerate(fields.get("tensors", list)))
        _check_disjoint(fields, tensors, PAYLOAD_OFFSET, PAYLOAD_OFFSET + payload_bytes)
        objects = Section.from_json(path, fields.get("objects", dict), "objects section")
        if objects.offset < PAYLOAD_OFFSET + in_file or objects.offset + objects.nbytes > file_bytes:
            raise fields.bad(f"objects section at offset {objects.offset} ({objects.nbytes} bytes) lies outside "
                             f"the file after the payload")
        names = fields.get("param_names", list)
        aliases = fields.get("param_aliases", dict)
        if not all(isinstance(n, str) for n in names) or not all(
                isinstance(v, int) and 0 <= v < len(names) for v in aliases.values()):
            raise fields.bad("param_names/param_aliases do not describe the optimizer's parameters")
        step, session, run, names, aliases, optimizer_class, compressor = cls.meta_fields(fields, names, aliases)
        return cls(step, session, run, payload_bytes, tensors, objects, names, aliases, optimizer_class, compressor,
                   stripes, unit)


def _check_disjoint(fields: _Fields, tensors: tuple, start: int, end: int) -> None:
    """Every tensor inside [start, end), none overlapping another, large ones page-aligned."""
    previous_end, previous_key = start, None
    for entry in sorted(tensors, key=lambda t: t.offset):
        if entry.offset < previous_end or entry.offset + entry.nbytes > end:
            where = f"overlaps {previous_key!r}" if entry.offset < previous_end else "lies outside the payload region"
            raise fields.bad(f"tensor {entry.key!r} at offset {entry.offset} ({entry.nbytes} bytes) {where}")
        if entry.nbytes >= PAGE and entry.offset % PAGE:
            raise fields.bad(f"tensor {entry.key!r} at offset {entry.offset} is not page-aligned")
        previous_end, previous_key = entry.offset + entry.nbytes, entry.key


@dataclasses.dataclass(frozen=True)
class BatchIndex:
    """The index of a differential batch: records of steps ``first..last``."""

    first: int
    last: int
    session: str
    run: str | None
    records: tuple            # (step, offset, nbytes) per record, in step order

    def to_json(self) -> dict:
        return {"version": FORMAT_VERSION, "kind": "diff", "session": self.session, "run": self.run,
                "first": self.first, "last": self.last, "records": [list(r) for r in self.records]}

    @classmethod
    def from_json(cls, path: str, obj, records_end: int) -> BatchIndex:
        fields = check_header(path, obj, "diff")
        first, last = fields.count("first"), fields.count("last")
        records, expected_offset = [], None
        for position, item in enumerate(fields.get("records", list)):
            if not (isinstance(item, list) and len(item) == 3 and
                    all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item)):
                raise fields.bad(f"record entry #{position} is {item!r}, not [step, offset, nbytes]")
            step, offset, nbytes = item
            if step != first + position or (expected_offset is not None and offset != expected_offset) \
                    or offset + nbytes > records_end:
                raise fields.bad(f"record entry #{position} ({item}) is not step {first + position} right after "
                                 f"the previous record and inside the file")
            records.append((step, offset, nbytes))
            expected_offset = offset + nbytes
        if not records or records[-1][0] != last:
            raise fields.bad(f"its records do not run from step {first} to step {last}")
        return cls(first, last, fields.get("session", str), fields.get("run", (str, type(None)), None), tuple(records))


@dataclasses.dataclass(frozen=True)
class StepState:
    """What a record captures at the iteration boundary besides the gradient (its ``objects``):
    hyper-parameters used by the step and after the scheduler stepped, RNG states, persistent
    module buffers, extra_state state dicts, and the scheduler's and GradScaler's state (None
    when not used)."""

    groups_used: list
    groups_after: list
    rng: dict
    buffers: dict
    extra: dict
    scheduler: dict | None = None
    grad_scaler: dict | None = None

    def to_objects(self) -> dict:
        out = {"groups_used": self.groups_used, "groups_after": self.groups_after, "rng": self.rng,
               "buffers": self.buffers, "extra": self.extra}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler
        return out

    @classmethod
    def from_objects(cls, path: str, obj, where: str) -> StepState:
        fields = _Fields(path, obj, f"{where} objects")
        return cls(fields.get("groups_used", list), fields.get("groups_after", list), fields.get("rng", dict),
                   fields.get("buffers", dict), fields.get("extra", dict),
                   fields.get("scheduler", dict, None), fields.get("grad_scaler", dict, None))


@dataclasses.dataclass(frozen=True)
class FullState:
    """The state skeleton of a full checkpoint: everything needed to continue at its step."""

    model: dict
    optimizer: dict
    rng: dict
    extra: dict
    scheduler: dict | None = None
    residuals: dict = dataclasses.field(default_factory=dict)   # parameter position -> TopK residual
    grad_scaler: dict | None = None

    def to_tree(self) -> dict:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "extra": self.extra, "rng": self.rng, "residuals": self.residuals, "grad_scaler": self.grad_scaler}

    @classmethod
    def from_tree(cls, path: str, obj) -> FullState:
        fields = _Fields(path, obj, "state skeleton")
        optimizer = fields.get("optimizer", dict)
        if not isinstance(optimizer.get("param_groups"), list) or not isinstance(optimizer.get("state"), dict):
            raise fields.bad("its optimizer state has no param_groups/state")
        return cls(fields.get("model", dict), optimizer, fields.get("rng", dict), fields.get("extra", dict) or {},
                   fields.get("scheduler", dict, None) if obj.get("scheduler") is not None else None,
                   fields.get("residuals", dict, {}) or {},
                   fields.get("grad_scaler", dict, None) if obj.get("grad_scaler") is not None else None)
