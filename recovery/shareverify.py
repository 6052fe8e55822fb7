"""recovery.shareverify: ``verify`` for a partitioned directory: every listed share file of every
rank directory read completely and checked (pieces, own tensors, objects; every record of every
differential share), and which steps each complete full set can still be recovered to.
Nothing is changed; no process group is needed.
"""
from __future__ import annotations

import concurrent.futures
import os

import fastio
from lowdiff.errors import CheckpointError, CorruptCheckpointError
from lowdiff.manifest import FullEntry
from lowdiff.partition import rank_directories, read_manifests
from lowdiff.records import decode_record
from lowdiff.sharefile import parse_diff_share, read_full_share_index, read_own, read_share_bytes_into

from .distributed import plan_sets
from .replay import default_workers
from .verify import Problem, VerifyReport, checked


def _check_full_share(path: str) -> None:
    with fastio.Reader(path) as reader:
        index = read_full_share_index(path, reader)
        read_share_bytes_into(path, reader, index, bytearray(index.end - index.start))
        read_own(path, reader, index)


def _check_diff_share(path: str, entry) -> int | None:
    """The last step whose record verifies in order (raises on a damaged index)."""
    with open(path, "rb") as f:
        data = f.read()
    index = parse_diff_share(path, data)
    last = None
    for step, offset, nbytes in index.batch.records:
        decode_record(memoryview(data)[offset:offset + nbytes], path, offset, expected_step=step)
        last = step
    if last != entry.last:
        raise CorruptCheckpointError(path, f"holds steps {entry.first}..{last}, the manifest says "
                                           f"{entry.first}..{entry.last}")
    return last


def _check(path: str, entry):
    """(Problem or None, last good step or None)."""
    def check():
        if isinstance(entry, FullEntry):
            _check_full_share(path)
            return None, entry.step
        return None, _check_diff_share(path, entry)
    return checked(path, check)


def verify_partitioned(root, *, workers: int | None = None) -> VerifyReport:
    """Like ``recovery.verify`` for a partitioned directory; file names are ``rank-NNNNN/NAME``."""
    root = os.fspath(root)
    ranks = sorted(rank_directories(root))
    manifests = read_manifests(root, ranks)
    problems, jobs = [], []
    for rank in ranks:
        directory = os.path.join(root, f"rank-{rank:05d}")
        manifest = manifests[rank]
        if manifest is None and not any(n.startswith(("full-", "diff-")) for n in os.listdir(directory)):
            continue   # a rank that joined and has not written yet
        if manifest is None:
            problems.append(Problem(os.path.join(directory, "MANIFEST.json"), "CORRUPT",
                                    "missing or damaged: the shares of this rank are not used"))
            continue
        jobs += [(os.path.join(f"rank-{rank:05d}", e.file), e) for e in manifest.fulls + manifest.batches]
    with concurrent.futures.ThreadPoolExecutor(workers or default_workers()) as pool:
        results = list(pool.map(lambda job: _check(os.path.join(root, job[0]), job[1]), jobs))
    ok, reach = [], {}
    for (name, _), (problem, last) in zip(jobs, results):
        (problems.append(problem) if problem else ok.append(name))
        reach[name] = last
    try:
        sets, _ = plan_sets(root, None)
    except CheckpointError:
        sets = []
    recoverable = []
    for fset in sets:
        names = [os.path.relpath(path, root) for path in fset.files]
        if any(reach.get(n) is None for n in names):
            continue
        ends = [_chain_reach(fset.step, i, chain, reach) for i, chain in enumerate(fset.chains)]
        recoverable.append((fset.step, names[0], min(ends)))
    listed = [min(_listed_end(fset.step, i, chain, manifests) for i, chain in enumerate(fset.chains))
              for fset in sets]
    return VerifyReport(root, tuple(ok), (), (), tuple(problems), tuple(sorted(recoverable)), max(listed, default=-1))


def _chain_reach(step: int, share: int, chain: tuple, reach: dict) -> int:
    for name in chain:
        good = reach.get(os.path.join(f"rank-{share:05d}", name))
        if good is None:
            return step
        step = good
    return step


def _listed_end(step: int, share: int, chain: tuple, manifests: dict) -> int:
    batches = {b.file: b for b in manifests[share].batches} if manifests.get(share) else {}
    return batches[chain[-1]].last if chain and chain[-1] in batches else step
