"""recovery.partitioned.verify: ``verify`` for a partitioned directory: every listed share file of every
rank directory read completely and checked (pieces, own tensors, objects; every record of every
differential share), and which steps each complete full set can still be recovered to.
Nothing is changed; no process group is needed.
"""
from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import os

import fastio
from lowdiff.distributed import dtensors
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
from lowdiff.store.manifest import DIFF_RE, FULL_RE, MANIFEST_NAME, BatchEntry, FullEntry, entry_path
from recovery.partitioned.plan import plan
from recovery.pipeline.replay import verify_workers
from recovery.verify import Problem, VerifyReport, _inventory_problems, _manifest_problems, checked


def _check_full_share(path: str, entry: FullEntry, run):
    """The share's index, once every byte of the share verifies."""
    with fastio.Reader(path) as reader:
        index = read_full_share_index(path, reader)
        check_entry(path, entry, index, reader.size, run)
        if index.stripes:   # every stripe file's CRC-32C too (bytes no piece or tensor covers)
            with ShareBody(path, reader, index, check_stripes=True) as body:
                body.read_into(PAYLOAD_OFFSET, bytearray(index.body_bytes))
                body.check()
        read_share_bytes_into(path, reader, index, bytearray(index.end - index.start))
        read_own(path, reader, index)
    return index


def _check_diff_share(path: str, entry, run):
    """(Problem or None, the last step whose record verifies in order, the index); raises on a
    damaged index (without it the share's parameters are unknown: nothing of the file is usable)."""
    with open(path, "rb") as f:
        data = f.read()
    index = parse_diff_share(path, data)
    check_entry(path, entry, index.batch, len(data), run)
    last = None
    for step, offset, nbytes in index.batch.records:
        try:
            decode_record(memoryview(data)[offset:offset + nbytes], path, offset, expected_step=step)
        except CorruptCheckpointError as exc:
            return Problem(path, "CORRUPT", exc.problem), last, index
        last = step
    return None, last, index


def _check(path: str, entry, run):
    """(Problem or None, last good step or None, the share's index or None: unreadable)."""
    found: list = [None]

    def check():
        if isinstance(entry, FullEntry):
            found[0] = _check_full_share(path, entry, run)
            return None, entry.step
        problem, last, found[0] = _check_diff_share(path, entry, run)
        return problem, last
    problem, last = checked(path, check)
    return problem, last, found[0]


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
    problems, jobs, adopted, gone = [], [], [], {}
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
        gone.update(_listed_missing(directory, inventory.missing))
    with concurrent.futures.ThreadPoolExecutor(workers or verify_workers()) as pool:
        results = list(pool.map(lambda job: _check(job[3], job[1], job[2]), jobs))
    ok, reach, found = [], {}, {}
    for (name, entry, _, path), (problem, last, index) in zip(jobs, results):
        (problems.append(problem) if problem else ok.append(name))
        reach[name] = last
        found[name] = (path, index, problem, entry)
    found.update(gone)   # (reported as MISSING above; named here as the holders they may be)
    manifests = {rank: inventory.manifest for rank, inventory in views.items()}
    planned = plan(root, None, views)
    sets = planned.sets
    # HSDP: a share is usable only with the chunks it names in `elsewhere` ("2-D meshes").
    for name, (why, unusable) in sorted(holder_problems(found).items()):
        problems.append(Problem(found[name][0], "HOLDER", why))
        ok.remove(name)
        if unusable:   # the holder verifies but lacks the chunk: the set (or chain) ends before this file
            reach[name] = None
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


# ---------------------------------------------------------------- HSDP: the chunks named elsewhere
def holder_problems(found: dict) -> dict:
    """{name: (why, unusable)} of the listed shares whose `elsewhere` (HSDP, docs/format.md, "2-D
    meshes") names a share that is missing or does not verify (its own problem says why), or one
    that verifies but does not hold the chunk with the same key, chunk entry (offsets, shape, mesh,
    placements) and dtype (``unusable``: the file is of no use although its own bytes verify).
    ``found``: {name ("rank-NNNNN/FILE"): (path, index or None, Problem or None, manifest entry)} of
    every listed share file. The holder of a full share's chunk is the holding rank's listed share of
    the same step and session; of a differential share's, its listed files of the same session whose
    steps meet the file's. A holder its rank never listed is not a fault here (the set is incomplete,
    or that rank's chain ends sooner: a crash; resume and the recoverable steps account for it). A
    share with a problem of its own is not judged again."""
    fulls: dict = {}
    batches: dict = {}
    for name, (_, _, _, entry) in found.items():
        rank = int(name.split("/")[0][len("rank-"):])
        if isinstance(entry, FullEntry):
            fulls[(rank, entry.step, entry.session)] = name
        else:
            batches.setdefault((rank, entry.session), []).append((entry.first, entry.last, name))
    spans = {key: ([hi for _, hi, _ in sorted(items)], sorted(items)) for key, items in batches.items()}
    out: dict = {}
    for name, (_, own, problem, entry) in sorted(found.items()):
        if problem is not None or own is None or not own.elsewhere:
            continue
        if isinstance(entry, FullEntry):
            pairs = [(key, where["share"], fulls.get((where["share"], entry.step, entry.session)))
                     for key, where in own.elsewhere.items()]
            _judge(out, found, name, own, [pair for pair in pairs if pair[2] is not None], dtensors.lacks_chunk)
        else:
            holders = {j: _overlapping(spans.get((j, entry.session), ([], [])), entry.first, entry.last)
                       for j in set(own.elsewhere.values())}
            _judge(out, found, name, own, [(slot, j, holder) for slot, j in own.elsewhere.items()
                                           for holder in holders[j]], dtensors.lacks_gradient_chunk)
    return out


def _listed_missing(directory: str, names) -> dict:
    """``found`` entries for the share files a rank's manifest lists that do not exist (the
    inventory drops them from its view; _inventory_problems reports them), by their names."""
    out: dict = {}
    name = os.path.basename(directory)
    for file in names:
        path = os.path.join(directory, file)
        problem = Problem(path, "MISSING", "missing")
        full, diff = FULL_RE.match(file), DIFF_RE.match(file)
        if full:
            out[os.path.join(name, file)] = (path, None, problem, FullEntry(int(full[1]), file, 0, full[2]))
        elif diff:
            out[os.path.join(name, file)] = (path, None, problem, BatchEntry(int(diff[1]), int(diff[2]), file, 0,
                                                                             diff[3]))
    return out


def _overlapping(share_spans: tuple, first: int, last: int) -> list:
    """The names of one share's files ((their last steps, [(first, last, name)]) in step order) whose
    steps meet [first, last]."""
    lasts, spans = share_spans
    out = []
    for lo, _, name in spans[bisect.bisect_left(lasts, first):]:
        if lo > last:
            break
        out.append(name)
    return out


def _judge(out: dict, found: dict, name: str, own, pairs: list, lacks) -> None:
    """Set ``out[name]`` to what is wrong with the holders ``pairs`` ([(key or slot, share, holder's
    name)]) that share ``own`` (its index) names."""
    damaged: dict = {}
    lacking: dict = {}
    for key, share, holder in sorted(pairs, key=lambda p: (p[2], str(p[0]))):
        path, index, problem, _ = found.get(holder, (holder, None, None, None))
        if index is None or problem is not None:
            state = "is missing" if problem is not None and problem.label == "MISSING" else "does not verify"
            damaged.setdefault((share, path, state), []).append(key)
        else:
            what = lacks(own, index, key)
            if what:
                lacking.setdefault((share, path), []).append(what)
    whys = [f"share {share} ({path}), which {state}, holds its {_chunks(keys)}"
            for (share, path, state), keys in damaged.items()]
    whys += [f"share {share} ({path}) is named for chunks it does not hold: it has {'; '.join(what[:3])}"
             + (f" (and {len(what) - 3} more)" if len(what) > 3 else "") for (share, path), what in lacking.items()]
    if whys:
        out[name] = ("; ".join(whys) + " (HSDP writes each chunk once: this file is of no use without it)",
                     bool(lacking))


def _chunks(keys: list) -> str:
    """The chunks named: of state keys (full shares) or of parameters by slot (differential shares)."""
    shown = ", ".join(map(repr if isinstance(keys[0], str) else str, keys[:3])) + \
        (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    many = "s" * (len(keys) > 1)
    return f"chunk{many} of {shown}" if isinstance(keys[0], str) else f"gradient chunk{many} of parameter{many} {shown}"
