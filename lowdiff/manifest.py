"""The manifest: the list of committed full checkpoints and differential batches of a directory.

Committing (``write_manifest``): temp file, fsync, ``os.replace``, directory fsync. A file is
part of the checkpoint only once the manifest lists it. If the manifest itself is lost or damaged,
``scan_directory`` rebuilds the list from the files, which are self-describing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib

from .errors import CorruptCheckpointError, VersionMismatchError

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_VERSION = 1
FULL_RE = re.compile(r"^full-(\d{12})-([0-9a-f]{8})\.ldf$")
DIFF_RE = re.compile(r"^diff-(\d{12})-(\d{12})-([0-9a-f]{8})\.ldd$")


def full_name(step: int, session: str) -> str:
    return f"full-{step:012d}-{session}.ldf"


def diff_name(first: int, last: int, session: str) -> str:
    return f"diff-{first:012d}-{last:012d}-{session}.ldd"


@dataclasses.dataclass(frozen=True)
class FullEntry:
    step: int
    file: str
    nbytes: int
    session: str


@dataclasses.dataclass(frozen=True)
class BatchEntry:
    first: int
    last: int
    file: str
    nbytes: int
    session: str


@dataclasses.dataclass
class Manifest:
    fulls: list = dataclasses.field(default_factory=list)     # FullEntry, in commit order
    batches: list = dataclasses.field(default_factory=list)   # BatchEntry, in commit order
    # True when rebuilt by scanning files (the committed manifest was missing or damaged).
    rebuilt: bool = dataclasses.field(default=False, compare=False)

    def to_json(self) -> bytes:
        body = {"version": MANIFEST_VERSION,
                "fulls": [dataclasses.asdict(e) for e in self.fulls],
                "batches": [dataclasses.asdict(e) for e in self.batches]}
        text = json.dumps(body, indent=1, sort_keys=True)
        return json.dumps({"crc32": zlib.crc32(text.encode()), "manifest": body}, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, path: str) -> "Manifest":
        try:
            outer = json.loads(data)
            body = outer["manifest"]
            text = json.dumps(body, indent=1, sort_keys=True)
            if zlib.crc32(text.encode()) != outer["crc32"]:
                raise CorruptCheckpointError(path, "manifest checksum mismatch")
            if body.get("version") != MANIFEST_VERSION:
                raise VersionMismatchError(path, f"manifest version {body.get('version')!r}, expected {MANIFEST_VERSION}")
            return cls([FullEntry(**e) for e in body["fulls"]], [BatchEntry(**e) for e in body["batches"]])
        except CorruptCheckpointError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(path, f"manifest is not valid: {type(exc).__name__}: {exc}") from None

    def durable_step(self) -> int:
        """The newest step reachable from some full checkpoint through contiguous batches (-1 if none)."""
        return max((chain_end(self, full.step, plan_chain(self, full.step)) for full in self.fulls), default=-1)


def plan_chain(manifest: Manifest, base_step: int) -> list:
    """The batches that continue ``base_step`` contiguously, newest commit preferred at each step."""
    chain, cursor = [], base_step
    while True:
        candidates = [b for b in manifest.batches if b.first == cursor + 1]
        if not candidates:
            return chain
        chosen = candidates[-1]
        chain.append(chosen)
        cursor = chosen.last


def chain_end(manifest: Manifest, base_step: int, chain: list) -> int:
    return chain[-1].last if chain else base_step


def write_manifest(directory: str, manifest: Manifest) -> None:
    from fastio._files import fsync_directory

    path = os.path.join(directory, MANIFEST_NAME)
    tmp = path + f".tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        data = manifest.to_json()
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_directory(directory)


def read_manifest(directory: str) -> Manifest | None:
    """The committed manifest, None if there is none. Raises CorruptCheckpointError if damaged."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return Manifest.from_json(data, path)


def scan_directory(directory: str) -> Manifest:
    """Rebuild a manifest from the checkpoint files present (used when the manifest is damaged).
    Files whose index does not verify are left out; batches keep step order, fulls step order."""
    from .batchfile import BatchReader
    from .fullckpt import read_full_index

    manifest = Manifest()
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if m := FULL_RE.match(name):
            try:
                index = read_full_index(path)
            except (CorruptCheckpointError, OSError, EOFError):
                continue
            manifest.fulls.append(FullEntry(index["step"], name, os.path.getsize(path), m.group(2)))
        elif m := DIFF_RE.match(name):
            try:
                with BatchReader(path) as reader:
                    steps = reader.steps
            except (CorruptCheckpointError, OSError, EOFError):
                continue
            if steps:
                manifest.batches.append(BatchEntry(steps[0], steps[-1], name, os.path.getsize(path), m.group(3)))
    manifest.fulls.sort(key=lambda e: e.step)
    return manifest


def load_manifest(directory: str, warn=None) -> Manifest:
    """The manifest, or one rebuilt by scanning when it is missing or damaged (reported via ``warn``)."""
    try:
        manifest = read_manifest(directory)
    except CorruptCheckpointError as exc:
        if warn:
            warn(f"{exc}; rebuilding the list of checkpoints from the files in {directory}")
        return dataclasses.replace(scan_directory(directory), rebuilt=True)
    if manifest is None:
        manifest = dataclasses.replace(scan_directory(directory), rebuilt=True)
        if (manifest.fulls or manifest.batches) and warn:
            warn(f"{os.path.join(directory, MANIFEST_NAME)} is missing; rebuilt it from the files")
    return manifest

