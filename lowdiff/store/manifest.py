"""The manifest: the list of committed full checkpoints and differential batches of a directory,
the run they belong to, and the files its commit retired (the only files a trainer may delete).

Committing (``write_manifest``): temp file, fsync, ``os.replace``, directory fsync. A file is
part of the checkpoint only once the manifest lists it. If the manifest itself is lost or damaged,
``scan_directory`` rebuilds the list from the files, which are self-describing (lowdiff.store.inventory
reconciles the manifest with the directory).
"""
from __future__ import annotations

import os
import re

import fastio
from lowdiff.format.container import (
    MANIFEST_VERSION,
    BatchEntry,
    FullEntry,
    ManifestRecord,
    RetiredEntry,
    read_file,
    write_json_file,
)

__all__ = ["DIFF_RE", "FULL_RE", "MANIFEST_NAME", "MANIFEST_VERSION", "BatchEntry", "FullEntry", "Manifest",
           "RetiredEntry", "chain_end", "describe_retained", "diff_name", "entry_path", "full_name", "plan_chain",
           "read_manifest", "write_manifest"]

MANIFEST_NAME = "MANIFEST.json"
FULL_RE = re.compile(r"^full-(\d{12})-([0-9a-f]{8})\.ldf$")
DIFF_RE = re.compile(r"^diff-(\d{12})-(\d{12})-([0-9a-f]{8})\.ldd$")


def full_name(step: int, session: str) -> str:
    return f"full-{step:012d}-{session}.ldf"


def diff_name(first: int, last: int, session: str) -> str:
    return f"diff-{first:012d}-{last:012d}-{session}.ldd"


def entry_path(directory: str, entry) -> str:
    """Where the file of a manifest entry of ``directory`` is: in its ``dir`` (a batch written to
    another drive, docs/format.md "Differential batches on the drives"), else in ``directory``."""
    where = getattr(entry, "dir", None)
    return os.path.join(where if where is not None else directory, entry.file)


class Manifest(ManifestRecord):
    """A directory's manifest: its fields and JSON are lowdiff.format.container's ``ManifestRecord``;
    here, what the listed files reach."""

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
    write_json_file(os.path.join(directory, MANIFEST_NAME), manifest.to_json(), priority=fastio.URGENT,
                    fault="manifest-write")


def read_manifest(directory: str) -> Manifest | None:
    """The committed manifest, None if there is none. Raises CorruptCheckpointError if damaged."""
    path = os.path.join(directory, MANIFEST_NAME)
    data = read_file(path)
    return None if data is None else Manifest.from_json(data, path)
