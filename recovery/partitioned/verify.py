"""recovery.partitioned.verify: ``verify`` for a partitioned directory: every listed share file of every
rank directory read completely and checked (pieces, own tensors, objects; every record of every
differential share), and which steps each complete full set can still be recovered to.
Nothing is changed; no process group is needed.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os

import fastio
from lowdiff.distributed.partition import rank_directory, read_views
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format.records import decode_record
from lowdiff.format.schema import PAYLOAD_OFFSET
from lowdiff.format.sharefile import (
    ShareBody,
    parse_diff_share,
    read_full_share_index,
    read_own,
    read_share_bytes_into,
)
from lowdiff.store.inventory import check_entry
from lowdiff.store.manifest import MANIFEST_NAME, FullEntry, entry_path
from recovery.partitioned.plan import plan
from recovery.pipeline.replay import verify_workers
from recovery.verify import Problem, VerifyReport, _inventory_problems, _manifest_problems, checked


def _check_full_share(path: str, entry: FullEntry, run) -> None:
    with fastio.Reader(path) as reader:
        index = read_full_share_index(path, reader)
        check_entry(path, entry, index, reader.size, run)
        if index.stripes:   # every stripe file's CRC-32C too (bytes no piece or tensor covers)
            with ShareBody(path, reader, index, check_stripes=True) as body:
                body.read_into(PAYLOAD_OFFSET, bytearray(index.body_bytes))
                body.check()
        read_share_bytes_into(path, reader, index, bytearray(index.end - index.start))
        read_own(path, reader, index)


def _check_diff_share(path: str, entry, run):
    """(Problem or None, the last step whose record verifies in order); raises on a damaged index
    (without it the share's parameters are unknown: nothing of the file is usable)."""
    with open(path, "rb") as f:
        data = f.read()
    index = parse_diff_share(path, data)
    check_entry(path, entry, index.batch, len(data), run)
    last = None
    for step, offset, nbytes in index.batch.records:
        try:
            decode_record(memoryview(data)[offset:offset + nbytes], path, offset, expected_step=step)
        except CorruptCheckpointError as exc:
            return Problem(path, "CORRUPT", exc.problem), last
        last = step
    return None, last


def _check(path: str, entry, run):
    """(Problem or None, last good step or None)."""
    def check():
        if isinstance(entry, FullEntry):
            _check_full_share(path, entry, run)
            return None, entry.step
        return _check_diff_share(path, entry, run)
    return checked(path, check)


def _rank_problems(directory: str, inventory) -> list:
    """What is wrong with a rank directory's manifest and unlisted files (as recovery.verify says
    it of a directory); a rebuilt list says how many share files it was rebuilt from."""
    problems = _manifest_problems(directory) + _inventory_problems(directory, inventory)
    if inventory.manifest.rebuilt:
        found = f"; rebuilt from the share files: {len(inventory.manifest.files())} found and used"
        problems = [dataclasses.replace(p, why=p.why + found) if os.path.basename(p.file) == MANIFEST_NAME else p
                    for p in problems]
    return problems


def verify_partitioned(root, *, workers: int | None = None) -> VerifyReport:
    """Like ``recovery.verify`` for a partitioned directory; file names are ``rank-NNNNN/NAME``. A
    rank's missing or damaged manifest is reported, and the share files it listed are found and
    checked anyway (lowdiff.distributed.partition.read_views)."""
    root = os.fspath(root)
    views = read_views(root, skip_other_versions=True)
    problems, jobs, adopted = [], [], []
    for rank, inventory in views.items():
        directory = rank_directory(root, rank)
        manifest = inventory.manifest
        if not manifest.files() and not inventory.ignored and inventory.committed is None:
            continue   # a rank that joined and has not written yet
        problems += _rank_problems(directory, inventory)
        name = os.path.basename(directory)
        # (Named rank-NNNNN/NAME wherever the rank directory is: on another drive, its DRIVE.json says.)
        jobs += [(os.path.join(name, e.file), e, manifest.run, entry_path(directory, e))
                 for e in manifest.fulls + manifest.batches]
        adopted += [os.path.join(name, n) for n in inventory.adopted]
    with concurrent.futures.ThreadPoolExecutor(workers or verify_workers()) as pool:
        results = list(pool.map(lambda job: _check(job[3], job[1], job[2]), jobs))
    ok, reach = [], {}
    for (name, _, _, _), (problem, last) in zip(jobs, results):
        (problems.append(problem) if problem else ok.append(name))
        reach[name] = last
    manifests = {rank: inventory.manifest for rank, inventory in views.items()}
    planned = plan(root, None, views)
    sets = planned.sets
    problems += [Problem(rank_directory(root, rank), "MISSING",
                         f"the rank directory is missing; the full checkpoints of steps "
                         f"{', '.join(map(str, sorted(steps)))} need its shares (nothing is resumed or "
                         f"deleted without it: mount or copy it back)")
                 for rank, steps in sorted(planned.missing.items())]
    recoverable = []
    for fset in sets:
        names = [os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path)) for path in fset.files]
        if any(reach.get(n) is None for n in names):
            continue
        ends = [_chain_reach(fset.step, i, chain, reach, set(ok)) for i, chain in enumerate(fset.chains)]
        recoverable.append((fset.step, names[0], min(ends)))
    listed = [min(_listed_end(fset.step, i, chain, manifests) for i, chain in enumerate(fset.chains))
              for fset in sets]
    return VerifyReport(root, tuple(ok), tuple(n for n in ok if n in adopted), (), tuple(problems),
                        tuple(sorted(recoverable)), max(listed, default=-1))


def _chain_reach(step: int, share: int, chain: tuple, reach: dict, ok: set) -> int:
    """The last step share ``share``'s chain carries from ``step``: through its files while they
    verify; a file that verifies only in part ends it at its last good record."""
    for name in chain:
        path = os.path.join(f"rank-{share:05d}", name)
        if reach.get(path) is None:
            return step
        step = reach[path]
        if path not in ok:
            return step
    return step


def _listed_end(step: int, share: int, chain: tuple, manifests: dict) -> int:
    batches = {b.file: b for b in manifests[share].batches} if manifests.get(share) else {}
    return batches[chain[-1]].last if chain and chain[-1] in batches else step
