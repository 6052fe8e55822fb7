"""``python -m lowdiff inspect`` of a partitioned directory: the full sets (complete or not, their
shares and bytes), and each rank directory's differential shares. Reads manifests and indexes only."""
from __future__ import annotations

import os

import fastio

from .errors import CheckpointError
from .partition import rank_directories, read_manifests
from .sharefile import read_full_share_index


def _share_count(path: str) -> str:
    try:
        with fastio.Reader(path) as reader:
            index = read_full_share_index(path, reader)
        return f"share {index.index} of {index.count}, bytes {index.start}..{index.end} of {index.shared_bytes}"
    except (CheckpointError, OSError, EOFError) as exc:
        return f"unreadable: {exc}"


def describe(root: str) -> list[str]:
    """Lines describing the partitioned directory ``root``."""
    ranks = sorted(rank_directories(root))
    manifests = read_manifests(root, ranks)
    lines = [f"directory      {os.path.abspath(root)} (partitioned: {len(ranks)} rank directories)"]
    sets: dict = {}
    for rank, manifest in manifests.items():
        if manifest is None:
            lines.append(f"  rank-{rank:05d}: no readable MANIFEST.json")
            continue
        for full in manifest.fulls:
            sets.setdefault((full.step, full.session), {})[rank] = full
    lines.append(f"full checkpoint sets ({len(sets)}):")
    for (step, session), shares in sorted(sets.items()):
        first = next(iter(shares.values()))
        detail = _share_count(os.path.join(root, f"rank-{min(shares):05d}", first.file))
        count = int(detail.split(" of ")[1].split(",")[0]) if detail.startswith("share") else None
        complete = count is not None and all(i in shares for i in range(count))
        total = sum(f.nbytes for f in shares.values())
        lines.append(f"  step {step:>8}  session {session}  {len(shares)} shares, {total} bytes  "
                     f"{'complete' if complete else 'INCOMPLETE (not used)'}")
        for rank, full in sorted(shares.items()):
            lines.append(f"      rank-{rank:05d}/{full.file}  {full.nbytes} bytes  "
                         f"{_share_count(os.path.join(root, f'rank-{rank:05d}', full.file))}")
    for rank, manifest in sorted(manifests.items()):
        if manifest is not None and manifest.batches:
            steps = sum(b.last - b.first + 1 for b in manifest.batches)
            lines.append(f"  rank-{rank:05d}: {len(manifest.batches)} differential shares, steps "
                         f"{min(b.first for b in manifest.batches)}..{max(b.last for b in manifest.batches)} "
                         f"({steps} steps, {sum(b.nbytes for b in manifest.batches)} bytes)")
    return lines
