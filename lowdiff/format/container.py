"""The envelopes of every file kind: the binary container shared by full checkpoints, batches and
shares, and the atomic commit of the JSON files beside them (manifest, CONTROLLER.json, TIERS.json,
whose fields lowdiff.format.schema holds).

Binary layout (docs/format.md): a 16-byte preamble (magic, version, kind) at offset 0, the payloads,
a JSON index, and a 32-byte trailer at the very end that locates and checksums the index. The
index is written last because it carries checksums of payloads that are only known then.
"""
from __future__ import annotations

import json
import os
import struct
import zlib

import fastio
from lowdiff import faults
from lowdiff.errors import CorruptCheckpointError, ForeignFileError, VersionMismatchError  # noqa: F401 (re-exported)
from lowdiff.format.schema import FORMAT_VERSION

MAGIC = b"LOWDIFF\x00"
TRAILER_MAGIC = b"LDINDEX\x00"
KIND_FULL = 1
KIND_DIFF = 2
KIND_FULL_SHARE = 3   # a share of a full checkpoint in a partitioned directory (lowdiff.format.sharefile)
KIND_DIFF_SHARE = 4   # a share of differentials in a partitioned directory
KIND_NAMES = {KIND_FULL: "full checkpoint", KIND_DIFF: "differential batch",
              KIND_FULL_SHARE: "full-checkpoint share", KIND_DIFF_SHARE: "differential share"}

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
