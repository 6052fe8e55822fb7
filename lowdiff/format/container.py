"""The envelopes of every file kind: the binary container shared by full checkpoints, batches and
shares; and the JSON files beside them (MANIFEST.json, CONTROLLER.json, TIERS.json, DRIVE.json): their records
and their one atomic commit. (The binary files' indexes are lowdiff.format.schema.)

Binary layout (docs/format.md): a 16-byte preamble (magic, version, kind) at offset 0, the payloads,
a JSON index, and a 32-byte trailer at the very end that locates and checksums the index. The
index is written last because it carries checksums of payloads that are only known then.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import zlib

import fastio
from lowdiff import faults
from lowdiff.errors import CorruptCheckpointError, ForeignFileError, VersionMismatchError  # noqa: F401 (re-exported)
from lowdiff.format.schema import FORMAT_VERSION, Stripe

MAGIC = b"LOWDIFF\x00"
TRAILER_MAGIC = b"LDINDEX\x00"
KIND_FULL = 1
KIND_DIFF = 2
KIND_FULL_SHARE = 3   # a share of a full checkpoint in a partitioned directory (lowdiff.format.sharefile)
KIND_DIFF_SHARE = 4   # a share of differentials in a partitioned directory
KIND_NAMES = {KIND_FULL: "full checkpoint", KIND_DIFF: "differential batch",
              KIND_FULL_SHARE: "full-checkpoint share", KIND_DIFF_SHARE: "differential share"}

MANIFEST_VERSION = 1          # MANIFEST.json
CONTROLLER_VERSION = 1        # CONTROLLER.json
TIERS_VERSION = 1             # TIERS.json
DRIVE_VERSION = 1             # rank-NNNNN/DRIVE.json
BUCKET_MANIFEST_VERSION = 1   # MANIFEST-N.json of an object-store tier

PREAMBLE = struct.Struct("<8sHH4x")      # magic, version, kind, reserved
TRAILER = struct.Struct("<QQIHH8s")      # index offset, index length, index crc32, version, kind, magic


def preamble_bytes(kind: int) -> bytes:
    return PREAMBLE.pack(MAGIC, FORMAT_VERSION, kind)


def trailer_bytes(index_offset: int, index: bytes, kind: int) -> bytes:
    return TRAILER.pack(index_offset, len(index), zlib.crc32(index), FORMAT_VERSION, kind, TRAILER_MAGIC)


def encode_index(index: dict) -> bytes:
    return json.dumps(index, separators=(",", ":"), sort_keys=True).encode()


def check_preamble(path: str, data: bytes, kind: int) -> None:
    """Raise a precise error unless ``data`` starts a lowdiff file of ``kind`` we can read."""
    if len(data) < PREAMBLE.size:
        raise CorruptCheckpointError(path, f"file is truncated: {len(data)} bytes, shorter than the "
                                           f"{PREAMBLE.size}-byte preamble")
    magic, version, found_kind = PREAMBLE.unpack_from(data)
    if magic != MAGIC:
        raise ForeignFileError(path, f"not a lowdiff file (starts with {magic!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise VersionMismatchError(path, f"format version {version}, this lowdiff reads version {FORMAT_VERSION}")
    if found_kind != kind:
        raise CorruptCheckpointError(path, f"is a {KIND_NAMES.get(found_kind, f'kind {found_kind}')}, "
                                           f"expected a {KIND_NAMES[kind]}")


def file_kind(path: str) -> int | None:
    """The kind a lowdiff file's preamble names (None: too short or not a lowdiff file)."""
    with open(path, "rb") as f:
        data = f.read(PREAMBLE.size)
    if len(data) < PREAMBLE.size:
        return None
    magic, _, kind = PREAMBLE.unpack(data)
    return kind if magic == MAGIC else None


def check_version(path: str) -> None:
    """Raise VersionMismatchError if ``path`` is a lowdiff file of another format version (reads
    only its preamble; anything else wrong is left to the full check)."""
    with open(path, "rb") as f:
        data = f.read(PREAMBLE.size)
    if len(data) == PREAMBLE.size:
        magic, version, _ = PREAMBLE.unpack(data)
        if magic == MAGIC and version != FORMAT_VERSION:
            raise VersionMismatchError(path, f"format version {version}, this lowdiff reads version {FORMAT_VERSION}")


def read_index(path: str, read, file_bytes: int, kind: int) -> dict:
    """Check preamble and trailer and return the index as parsed JSON (lowdiff.format.schema validates
    its fields). ``read(offset, n) -> bytes``."""
    check_preamble(path, read(0, min(PREAMBLE.size, file_bytes)), kind)
    if file_bytes < PREAMBLE.size + TRAILER.size:
        raise CorruptCheckpointError(path, f"file is truncated: {file_bytes} bytes leave no room for the index trailer")
    index_offset, index_len, index_crc, version, found_kind, magic = TRAILER.unpack(
        read(file_bytes - TRAILER.size, TRAILER.size))
    if magic != TRAILER_MAGIC:
        raise CorruptCheckpointError(path, "index trailer missing at the end of the file (truncated or torn write)")
    if version != FORMAT_VERSION or found_kind != kind:
        raise CorruptCheckpointError(path, f"trailer says version {version} kind {found_kind}, preamble disagrees")
    if index_offset < PREAMBLE.size or index_offset + index_len != file_bytes - TRAILER.size:
        raise CorruptCheckpointError(path, f"index at offset {index_offset} length {index_len} does not end "
                                           f"where the trailer starts ({file_bytes - TRAILER.size})")
    raw = read(index_offset, index_len)
    if zlib.crc32(raw) != index_crc:
        raise CorruptCheckpointError(path, f"index checksum mismatch (index at offset {index_offset})")
    try:
        index = json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpointError(path, f"index is not valid JSON: {exc}") from None
    return index


# ------------------------------------------------------------------ the JSON files
def write_json_file(path: str, data: bytes, *, priority: int = fastio.BULK, fault: str | None = None,
                    is_dead_temp=None, unless_same: bool = False) -> None:
    """Replace ``path`` by ``data`` with the one commit protocol (fastio.Writer: temporary file,
    fdatasync, rename, directory fsync): a crash leaves the old file or the new one. First removes
    the temporaries of ``path`` that ``is_dead_temp(name)`` says a killed writer left; with
    ``unless_same`` writes nothing when the file holds ``data`` already. ``fault``: the fault point
    passed once the bytes are written, before the commit."""
    directory, name = os.path.split(path)
    if is_dead_temp is not None:
        for other in os.listdir(directory):
            if other.startswith(f".{name}.tmp-") and is_dead_temp(other):
                try:
                    os.unlink(os.path.join(directory, other))
                except FileNotFoundError:
                    pass
    if unless_same and read_file(path) == data:
        return
    with fastio.Writer(path, priority=priority) as writer:
        writer.write(data)
        if fault is not None:
            faults.point(fault)


def read_file(path: str) -> bytes | None:
    """The bytes of a JSON file (None: there is none)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


# ------------------------------------------------------------------ the JSON files
def encode_json_file(body) -> bytes:
    """The bytes of a JSON file beside the checkpoints (manifest, CONTROLLER.json, TIERS.json)."""
    return json.dumps(body, indent=1, sort_keys=True).encode()


@dataclasses.dataclass(frozen=True)
class FullEntry:
    """A committed full checkpoint (or share of one) that the manifest lists; ``stripes``: the
    files holding its payload when it is striped over several devices (schema.Stripe)."""
    step: int
    file: str
    nbytes: int
    session: str
    stripes: tuple = ()


@dataclasses.dataclass(frozen=True)
class BatchEntry:
    """A committed differential batch (or share of one) of steps ``first..last``; ``dir``: the
    absolute directory of the drive it was written to (None: the checkpoint directory itself)."""
    first: int
    last: int
    file: str
    nbytes: int
    session: str
    dir: str | None = None


@dataclasses.dataclass(frozen=True)
class RetiredEntry:
    """A file the commit of this manifest stopped listing: the next trainer may delete it (and
    its ``stripes`` first, when it is a striped full checkpoint); ``dir``: where it is, as its
    entry said (a batch on another drive)."""
    file: str
    nbytes: int
    stripes: tuple = ()
    dir: str | None = None


def _entry_json(entry) -> dict:
    """A manifest entry as JSON: ``stripes`` only when there are some and ``dir`` only when it is
    set, so the manifest of a directory without striping keeps its bytes."""
    # (fields by name, not dataclasses.asdict: that deep-copies, and a manifest of hundreds of
    # entries is written at every commit)
    out = {field.name: getattr(entry, field.name) for field in dataclasses.fields(entry)}
    stripes = out.pop("stripes", ())
    if stripes:
        out["stripes"] = [s.to_json() for s in entry.stripes]
    if out.get("dir", 0) is None:
        del out["dir"]
    return out


def _striped(cls, obj: dict, path: str):
    """``cls(**obj)`` with its ``stripes`` list read as schema.Stripe and its ``dir`` (an absolute
    path, when present) checked."""
    if "stripes" in obj:
        obj = {**obj, "stripes": tuple(Stripe.from_json(path, s, i) for i, s in enumerate(obj["stripes"]))}
    if obj.get("dir") is not None and not (isinstance(obj["dir"], str) and os.path.isabs(obj["dir"])):
        raise ValueError(f"entry of {obj.get('file')!r}: dir {obj['dir']!r} is not an absolute path")
    return cls(**obj)


@dataclasses.dataclass
class ManifestRecord:
    """MANIFEST.json (docs/format.md, "Manifest"); lowdiff.store.manifest adds the chains."""

    fulls: list = dataclasses.field(default_factory=list)     # FullEntry, in commit order
    batches: list = dataclasses.field(default_factory=list)   # BatchEntry, in commit order
    run: str | None = None                                    # the directory's run id (None: unknown)
    retired: list = dataclasses.field(default_factory=list)   # RetiredEntry
    rebuilt: bool = dataclasses.field(default=False, compare=False)   # by scanning files (no good manifest)

    def to_json(self) -> bytes:
        body = {"version": MANIFEST_VERSION, "fulls": [_entry_json(e) for e in self.fulls],
                "batches": [_entry_json(e) for e in self.batches],
                "retired": [_entry_json(e) for e in self.retired]}
        if self.run is not None:
            body["run"] = self.run
        # The bytes of encode_json_file({"crc32": ..., "manifest": body}), with the body encoded once:
        # nested one level deeper, each of its lines is indented by one more space (indent=1; a
        # line break inside a JSON string is escaped, so every raw one is a line of the layout).
        inner = encode_json_file(body)
        return b'{\n "crc32": %d,\n "manifest": %s\n}' % (zlib.crc32(inner), inner.replace(b"\n", b"\n "))

    def files(self) -> set:   # the names of the files listed
        return {f.file for f in self.fulls} | {b.file for b in self.batches}

    @classmethod
    def from_json(cls, data: bytes, path: str):
        try:
            outer = json.loads(data)
        except ValueError as exc:
            raise CorruptCheckpointError(path, f"manifest is not valid: {type(exc).__name__}: {exc}") from None
        if not isinstance(outer, dict) or not ({"crc32", "manifest"} & set(outer)):
            # Valid JSON that is not ours at all (damage cannot turn both keys into others): another
            # tool's file. Never rebuilt over, never overwritten.
            raise ForeignFileError(path, "is not a lowdiff manifest (valid JSON without 'crc32' or 'manifest'); "
                                         "refusing to use or overwrite it — is this the right directory?")
        try:
            body = outer["manifest"]
            if zlib.crc32(encode_json_file(body)) != outer["crc32"]:
                raise CorruptCheckpointError(path, "manifest checksum mismatch")
            if body.get("version") != MANIFEST_VERSION:
                raise VersionMismatchError(path, f"manifest version {body.get('version')!r}, this lowdiff reads "
                                                 f"version {MANIFEST_VERSION}")
            run = body.get("run")
            if run is not None and not isinstance(run, str):
                raise TypeError(f"run is {run!r}")
            return cls([_striped(FullEntry, e, path) for e in body["fulls"]],
                       [_striped(BatchEntry, e, path) for e in body["batches"]],
                       run, [_striped(RetiredEntry, e, path) for e in body.get("retired", [])])
        except (CorruptCheckpointError, VersionMismatchError):
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(path, f"manifest is not valid: {type(exc).__name__}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class ControllerState:
    """CONTROLLER.json (docs/format.md, "Controller measurements"): samples by name and the
    settings in force. Settings are kept as found; the controller judges whether they are sensible."""

    samples: dict             # name -> [float]
    full_every: object = None
    batch_steps: object = None
    differentials: object = None

    @classmethod
    def of(cls, samples: dict, settings: dict) -> ControllerState:
        """From samples by name and the settings by name (as the controller keeps them)."""
        return cls(samples, settings.get("full_every"), settings.get("batch_steps"), settings.get("differentials"))

    def settings(self) -> dict:
        return {"full_every": self.full_every, "batch_steps": self.batch_steps, "differentials": self.differentials}

    def to_json(self) -> bytes:
        return encode_json_file({"version": CONTROLLER_VERSION, "samples": self.samples, "settings": self.settings()})

    @classmethod
    def from_json(cls, data: bytes, path: str) -> ControllerState:
        """Raises ValueError naming ``path`` and what is wrong."""
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"{path}: cannot be read as JSON ({exc})") from None
        if not isinstance(body, dict) or body.get("version") != CONTROLLER_VERSION:
            version = body.get("version") if isinstance(body, dict) else None
            raise ValueError(f"{path}: version {version!r}, this lowdiff reads version {CONTROLLER_VERSION}")
        samples, settings = body.get("samples"), body.get("settings")
        if not isinstance(samples, dict) or not isinstance(settings, dict):
            raise ValueError(f"{path}: has no 'samples' and 'settings' objects")
        for name, values in samples.items():
            if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                       and math.isfinite(v) and v >= 0 for v in values):
                raise ValueError(f"{path}: samples[{name!r}] is not a list of numbers >= 0")
        return cls.of({name: [float(v) for v in values] for name, values in samples.items()}, settings)


@dataclasses.dataclass(frozen=True)
class TiersMarker:
    """TIERS.json (docs/format.md, "Storage tiers"): where the shared tier is; each tier's policy
    and the lag bound, informational (None when a file lacks them)."""

    shared_dir: str
    local_policy: str | None = None
    shared_policy: str | None = None
    max_lag_steps: int | None = None

    def to_json(self) -> bytes:
        return encode_json_file({"version": TIERS_VERSION, **dataclasses.asdict(self)})

    def fields(self) -> dict:
        """The fields by name, as the file holds them (one it lacks is absent)."""
        return {"version": TIERS_VERSION, **{k: v for k, v in dataclasses.asdict(self).items() if v is not None}}

    @classmethod
    def from_json(cls, data: bytes, path: str) -> TiersMarker:
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise CorruptCheckpointError(path, f"is not valid JSON: {exc}") from None
        if not isinstance(body, dict) or body.get("version") != TIERS_VERSION or \
                not isinstance(body.get("shared_dir"), str):
            raise CorruptCheckpointError(path, f"is not a version {TIERS_VERSION} tier marker")
        return cls(body["shared_dir"], body.get("local_policy"), body.get("shared_policy"), body.get("max_lag_steps"))


@dataclasses.dataclass(frozen=True)
class DriveRecord:
    """rank-NNNNN/DRIVE.json (docs/format.md, "Rank directories on several local drives"): the rank
    directory that ``rank-NNNNN/`` stands for, on another drive."""

    dir: str

    def to_json(self) -> bytes:
        return encode_json_file({"dir": self.dir, "version": DRIVE_VERSION})

    @classmethod
    def from_json(cls, data: bytes, path: str, rank_name: str) -> DriveRecord:
        """Check what ``path`` holds: a version 1 record whose ``dir`` is absolute and ends in
        ``rank_name`` (its own rank directory's name)."""
        try:
            body = json.loads(data)
        except ValueError as exc:
            raise CorruptCheckpointError(path, f"is not valid JSON: {exc}") from None
        if not isinstance(body, dict) or not isinstance(body.get("version"), int) or isinstance(body["version"], bool):
            raise CorruptCheckpointError(path, "is not a drive record (no integer 'version')")
        if body["version"] != DRIVE_VERSION:
            raise VersionMismatchError(path, f"drive record version {body['version']}; this lowdiff reads "
                                             f"version {DRIVE_VERSION}")
        where = body.get("dir")
        if not isinstance(where, str) or not os.path.isabs(where) or os.path.basename(where) != rank_name:
            raise CorruptCheckpointError(path, f"'dir' is {where!r}: it must be an absolute path ending in {rank_name}")
        return cls(where)


@dataclasses.dataclass(frozen=True)
class BucketManifest:
    """MANIFEST-N.json of an object-store tier (docs/format.md, "Shared tier in an object store"):
    commit number ``seq``, the directory manifest it commits (``manifest``: a ManifestRecord) and
    {name: (nbytes, crc32c)} of every file that lists."""

    seq: int
    manifest: ManifestRecord
    objects: dict

    def to_json(self) -> bytes:
        body = {"version": BUCKET_MANIFEST_VERSION, "seq": self.seq, "manifest": json.loads(self.manifest.to_json()),
                "objects": {name: {"nbytes": n, "crc32c": c} for name, (n, c) in sorted(self.objects.items())}}
        return encode_json_file({"crc32": zlib.crc32(encode_json_file(body)), "bucket_manifest": body})

    @classmethod
    def from_json(cls, data: bytes, where: str, manifest_type=ManifestRecord) -> BucketManifest:
        try:
            outer = json.loads(data)
            body = outer["bucket_manifest"]
            if zlib.crc32(encode_json_file(body)) != outer["crc32"]:
                raise CorruptCheckpointError(where, "bucket manifest checksum mismatch")
            if body.get("version") != BUCKET_MANIFEST_VERSION:
                raise VersionMismatchError(where, f"bucket manifest version {body.get('version')!r}, this lowdiff "
                                                  f"reads version {BUCKET_MANIFEST_VERSION}")
            manifest = manifest_type.from_json(encode_json_file(body["manifest"]), where)
            objects = {str(name): (int(o["nbytes"]), int(o["crc32c"])) for name, o in body["objects"].items()}
            if not isinstance(body["seq"], int) or set(objects) != manifest.files():
                raise ValueError("its objects are not the files its manifest lists")
            return cls(body["seq"], manifest, objects)
        except (CorruptCheckpointError, VersionMismatchError):
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(where, f"bucket manifest is not valid: {type(exc).__name__}: {exc}") from None
