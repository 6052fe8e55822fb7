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
    rank_directory,
    read_views,
    retained_ranges,
)
from lowdiff.errors import CheckpointError
from lowdiff.format.sharefile import read_full_share_index


def _share_index(path: str):
    """The full share's index, or why it cannot be read (a string)."""
    try:
        with fastio.Reader(path) as reader:
            return read_full_share_index(path, reader)
    except (CheckpointError, OSError, EOFError) as exc:
        return f"unreadable: {exc}"


def _share_summary(index) -> str:
    """One share's part of its set: its own tensors (how many are DTensor chunks) and its range of
    the shared payload. A sharded run's shares hold mostly chunks and often no shared bytes at all
    (the set's few replicated tensors fall in one share's range): said in words, not as "0..0"."""
    if isinstance(index, str):
        return index
    held = len(index.dtensors) - len(index.elsewhere)
    chunks = f" ({held} of them DTensor chunks)" if index.dtensors else ""
    if index.elsewhere:   # HSDP: written by another rank of the replicate group (docs/format.md, "2-D meshes")
        lenders = sorted({e["share"] for e in index.elsewhere.values()})
        chunks += f", {len(index.elsewhere)} chunk{'s' * (len(index.elsewhere) > 1)} in share" \
                  f"{'s' * (len(lenders) > 1)} {', '.join(str(j) for j in lenders)}"
    if index.shared_bytes == 0:
        shared = "no shared payload"
    elif index.start == index.end:
        shared = f"none of the {index.shared_bytes}-byte shared payload"
    else:
        shared = f"shared payload bytes {index.start}..{index.end} of {index.shared_bytes}"
    return f"share {index.index} of {index.count}: {len(index.tensors)} own tensors{chunks}, {shared}"


def _extent(entry: dict) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(entry["offsets"], entry["shape"])) + "]"


def _chunk_lines(step: int, indexes: dict) -> list[str]:
    """Each DTensor of a set once: global shape, mesh and placements, and every share's chunk as
    the global ranges it covers (docs/format.md, "Sharded state")."""
    keys = sorted({key for index in indexes.values() for key in index.dtensors})
    if not keys:
        return []
    lines = [f"sharded tensors of the set of step {step} (each share holds its chunk; global ranges by share):"]
    for key in keys:
        entries = {rank: index.dtensors[key] for rank, index in indexes.items()
                   if key in index.dtensors and key not in index.elsewhere}   # the shares that hold it
        first = next(iter(entries.values()))
        where = ", ".join(f"{rank}: {_extent(e)}" if all(e["shape"]) else f"{rank}: empty"
                          for rank, e in entries.items())
        lines.append(f"  {key}  global {first['global_shape']}  {'/'.join(first['placements'])} on mesh "
                     f"{first['mesh_shape']}  chunks {where}")
    return lines


def describe(root: str, warn=None) -> list[str]:
    """Lines describing the partitioned directory ``root``; ``warn(note)`` gets what reconciling
    each rank directory found (a manifest rebuilt from the share files, files not used)."""
    views = read_views(root, skip_other_versions=True)
    manifests = {rank: inventory.manifest for rank, inventory in views.items()}
    sets = full_sets(root, manifests)
    lines = [f"directory      {os.path.abspath(root)} (partitioned: {len(views)} rank directories)",
             f"durable step   {max(durable_step(manifests, sets), 0)} (every share of a complete set reaches it)",
             f"retained       {describe_ranges(retained_ranges(manifests, sets), sets)}"]
    for rank in sorted(views):   # (a rank directory on another drive: docs/format.md, "Rank directories on ...")
        where = rank_directory(root, rank)
        if os.path.abspath(os.path.dirname(where)) != os.path.abspath(root):
            lines.append(f"  rank-{rank:05d}: on {where}")
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
    newest_chunks: list[str] = []   # the newest complete set's DTensors (sets are listed oldest first)
    for fset in sets:
        shares = {rank: next(f for f in manifests[rank].fulls if (f.step, f.session) == (fset.step, fset.session))
                  for rank in sorted(fset.ranks)}
        total = sum(f.nbytes for f in shares.values())
        state = f"complete, reaches step {fset.reach(manifests)}" if fset.complete else "INCOMPLETE (not used)"
        lines.append(f"  step {fset.step:>8}  session {fset.session}  {len(shares)} shares, {total} bytes  {state}")
        indexes = {rank: _share_index(os.path.join(rank_directory(root, rank), full.file))
                   for rank, full in shares.items()}
        for rank, full in shares.items():
            lines.append(f"      rank-{rank:05d}/{full.file}  {full.nbytes} bytes  {_share_summary(indexes[rank])}")
        if fset.complete and all(not isinstance(i, str) for i in indexes.values()):
            newest_chunks = _chunk_lines(fset.step, indexes) or newest_chunks
    for rank, manifest in manifests.items():
        if manifest.batches:
            steps = sum(b.last - b.first + 1 for b in manifest.batches)
            lines.append(f"  rank-{rank:05d}: {len(manifest.batches)} differential shares, steps "
                         f"{min(b.first for b in manifest.batches)}..{max(b.last for b in manifest.batches)} "
                         f"({steps} steps, {sum(b.nbytes for b in manifest.batches)} bytes)")
        for name, why, _ in views[rank].ignored:
            lines.append(f"  rank-{rank:05d}: not used: {name}: {why}")
    return lines + newest_chunks
