"""The manifest: the list of committed full checkpoints and differential batches of a directory,
the run they belong to, and the files its commit retired (the only files a trainer may delete).

Committing (``write_manifest``): temp file, fsync, ``os.replace``, directory fsync. A file is
part of the checkpoint only once the manifest lists it. If the manifest itself is lost or damaged,
``scan_directory`` rebuilds the list from the files, which are self-describing (lowdiff.store.inventory
reconciles the manifest with the directory).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import zlib

import fastio
from lowdiff import faults
from lowdiff.errors import CorruptCheckpointError, ForeignFileError, VersionMismatchError

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


@dataclasses.dataclass(frozen=True)
class RetiredEntry:
    """A file the commit of this manifest stopped listing: the next trainer may delete it."""
    file: str
    nbytes: int


@dataclasses.dataclass
class Manifest:
    fulls: list = dataclasses.field(default_factory=list)     # FullEntry, in commit order
    batches: list = dataclasses.field(default_factory=list)   # BatchEntry, in commit order
    run: str | None = None                                    # the directory's run id (None: unknown)
    retired: list = dataclasses.field(default_factory=list)   # RetiredEntry
    # True when rebuilt by scanning files (the committed manifest was missing or damaged).
    rebuilt: bool = dataclasses.field(default=False, compare=False)

    def to_json(self) -> bytes:
        body = {"version": MANIFEST_VERSION,
                "fulls": [dataclasses.asdict(e) for e in self.fulls],
                "batches": [dataclasses.asdict(e) for e in self.batches],
                "retired": [dataclasses.asdict(e) for e in self.retired]}
        if self.run is not None:
            body["run"] = self.run
        text = json.dumps(body, indent=1, sort_keys=True)
        return json.dumps({"crc32": zlib.crc32(text.encode()), "manifest": body}, indent=1, sort_keys=True).encode()

    def files(self) -> set:
        """Names of the files listed."""
        return {f.file for f in self.fulls} | {b.file for b in self.batches}

    @classmethod
    def from_json(cls, data: bytes, path: str) -> Manifest:
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
            text = json.dumps(body, indent=1, sort_keys=True)
            if zlib.crc32(text.encode()) != outer["crc32"]:
                raise CorruptCheckpointError(path, "manifest checksum mismatch")
            if body.get("version") != MANIFEST_VERSION:
                raise VersionMismatchError(path, f"manifest version {body.get('version')!r}, this lowdiff reads "
                                                 f"version {MANIFEST_VERSION}")
            run = body.get("run")
            if run is not None and not isinstance(run, str):
                raise TypeError(f"run is {run!r}")
            return cls([FullEntry(**e) for e in body["fulls"]], [BatchEntry(**e) for e in body["batches"]],
                       run, [RetiredEntry(**e) for e in body.get("retired", [])])
        except (CorruptCheckpointError, VersionMismatchError):
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(path, f"manifest is not valid: {type(exc).__name__}: {exc}") from None

    def durable_step(self) -> int:
        """The newest step reachable from some full checkpoint through contiguous batches (-1 if none)."""
        return max((chain_end(self, full.step, plan_chain(self, full.step)) for full in self.fulls), default=-1)

    def retained_ranges(self) -> list:
        """[(first, last)] step ranges some full checkpoint reaches through its chain, merged."""
        spans = sorted((f.step, chain_end(self, f.step, plan_chain(self, f.step))) for f in self.fulls)
        merged: list = []
        for first, last in spans:
            if merged and first <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], last))
            else:
                merged.append((first, last))
        return merged

    def retains(self, step: int) -> bool:
        return any(first <= step <= last for first, last in self.retained_ranges())


def plan_chain(manifest: Manifest, base_step: int) -> list[BatchEntry]:
    """The batches that continue ``base_step`` contiguously, newest commit preferred at each step."""
    chain: list[BatchEntry] = []
    cursor = base_step
    while True:
        candidates = [b for b in manifest.batches if b.first == cursor + 1]
        if not candidates:
            return chain
        chosen = candidates[-1]
        chain.append(chosen)
        cursor = chosen.last


def chain_end(manifest: Manifest, base_step: int, chain: list) -> int:
    return chain[-1].last if chain else base_step


def describe_retained(manifest: Manifest) -> str:
    """The steps a directory can still be restored to, for error messages."""
    ranges = manifest.retained_ranges()
    if not ranges:
        return "it retains no step (no full checkpoint is listed)"
    steps = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in ranges)
    fulls = ", ".join(str(f.step) for f in sorted(manifest.fulls, key=lambda f: f.step))
    return f"retained steps: {steps} (full checkpoints at steps {fulls})"


def write_manifest(directory: str, manifest: Manifest) -> None:
    """Commit ``manifest`` with the one commit protocol every lowdiff file uses (fastio.Writer:
    temporary file, fdatasync, rename over MANIFEST.json, directory fsync)."""
    with fastio.Writer(os.path.join(directory, MANIFEST_NAME), priority=fastio.URGENT) as writer:
        writer.write(manifest.to_json())
        faults.point("manifest-write")


def read_manifest(directory: str) -> Manifest | None:
    """The committed manifest, None if there is none. Raises CorruptCheckpointError if damaged."""
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    return Manifest.from_json(data, path)
