"""``python -m lowdiff inspect`` of a partitioned directory: the full sets (complete or not, their
shares and bytes), and each rank directory's differential shares. Reads manifests and indexes only."""
from __future__ import annotations

import os

import fastio
from lowdiff.distributed.partition import (
    describe_ranges,
    durable_step,
    full_sets,
    missing_rank_directories,
    read_views,
    retained_ranges,
)
from lowdiff.errors import CheckpointError
from lowdiff.format.sharefile import read_full_share_index


def _share_count(path: str) -> str:
    try:
        with fastio.Reader(path) as reader:
            index = read_full_share_index(path, reader)
        return f"share {index.index} of {index.count}, bytes {index.start}..{index.end} of {index.shared_bytes}"
    except (CheckpointError, OSError, EOFError) as exc:
        return f"unreadable: {exc}"


def describe(root: str, warn=None) -> list[str]:
    """Lines describing the partitioned directory ``root``; ``warn(note)`` gets what reconciling
    each rank directory found (a manifest rebuilt from the share files, files not used)."""
    views = read_views(root, skip_other_versions=True)
    manifests = {rank: inventory.manifest for rank, inventory in views.items()}
    sets = full_sets(root, manifests)
    lines = [f"directory      {os.path.abspath(root)} (partitioned: {len(views)} rank directories)",
             f"durable step   {max(durable_step(manifests, sets), 0)} (every share of a complete set reaches it)",
             f"retained       {describe_ranges(retained_ranges(manifests, sets), sets)}"]
    for rank, steps in sorted(missing_rank_directories(root, manifests, sets).items()):
        lines.append(f"  rank-{rank:05d}: MISSING: the directory does not exist, and the full checkpoints of "
                     f"steps {', '.join(map(str, sorted(steps)))} need its shares (mount or copy it back; "
                     f"resume refuses without it)")
    for rank, inventory in views.items():
        for note in inventory.notes:
            if warn is not None:
                warn(note)
        if inventory.manifest.rebuilt and inventory.manifest.files():
            lines.append(f"  rank-{rank:05d}: MANIFEST.json missing or damaged: the list below is rebuilt from "
                         f"its {len(inventory.manifest.files())} share files")
    lines.append(f"full checkpoint sets ({len(sets)}):")
    for fset in sets:
        shares = {rank: next(f for f in manifests[rank].fulls if (f.step, f.session) == (fset.step, fset.session))
                  for rank in sorted(fset.ranks)}
        total = sum(f.nbytes for f in shares.values())
        state = f"complete, reaches step {fset.reach(manifests)}" if fset.complete else "INCOMPLETE (not used)"
        lines.append(f"  step {fset.step:>8}  session {fset.session}  {len(shares)} shares, {total} bytes  {state}")
        for rank, full in shares.items():
            lines.append(f"      rank-{rank:05d}/{full.file}  {full.nbytes} bytes  "
                         f"{_share_count(os.path.join(root, f'rank-{rank:05d}', full.file))}")
    for rank, manifest in manifests.items():
        if manifest.batches:
            steps = sum(b.last - b.first + 1 for b in manifest.batches)
            lines.append(f"  rank-{rank:05d}: {len(manifest.batches)} differential shares, steps "
                         f"{min(b.first for b in manifest.batches)}..{max(b.last for b in manifest.batches)} "
                         f"({steps} steps, {sum(b.nbytes for b in manifest.batches)} bytes)")
        for name, why, _ in views[rank].ignored:
            lines.append(f"  rank-{rank:05d}: not used: {name}: {why}")
    return lines
