"""recovery.verify: read every listed file of a checkpoint directory completely, in parallel, and
say which steps can be recovered (from which full checkpoint) and every problem found.

A file is checked for its checksums and for being what its manifest entry says; a batch whose
records verify only in part still carries the chain up to the last good record. Nothing is
changed.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os

from lowdiff.errors import CorruptCheckpointError, VersionMismatchError
from lowdiff.format.batchfile import BatchReader
from lowdiff.format.fullckpt import load_full
from lowdiff.store.inventory import check_entry, take_inventory
from lowdiff.store.manifest import MANIFEST_NAME, FullEntry, Manifest, entry_path, plan_chain, read_manifest
from lowdiff.store.stripes import check_batch_device
from recovery.pipeline.replay import check_workers, verify_workers


@dataclasses.dataclass(frozen=True)
class Problem:
    file: str          # the file's path
    label: str         # CORRUPT, VERSION, MISSING, FOREIGN, HOLDER (HSDP: recovery.partitioned.verify)
    why: str


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    directory: str
    ok_files: tuple            # names of listed files that verify completely
    adopted: tuple             # names among them the manifest did not list (it was stale)
    gone: tuple                # names retired by a live trainer while verify ran
    problems: tuple            # Problem, one per file (or the manifest) that does not verify
    recoverable: tuple         # (full step, full file, last step reachable from it), oldest first
    newest_listed: int         # the newest step the listed files claim (-1: nothing)

    @property
    def newest_recoverable(self) -> int:
        return max((last for _, _, last in self.recoverable), default=-1)

    @property
    def ok(self) -> bool:
        """Everything verifies and the newest listed state can be reached."""
        return not self.problems and self.newest_recoverable >= self.newest_listed


_ATTEMPTS = 8   # fresh looks at a directory whose live trainer retired files while they were checked


def verify(directory, *, workers: int | None = None) -> VerifyReport:
    """Check every checksum, entry and chain of ``directory`` with ``workers`` threads. Beside a
    live trainer whose retention removed listed files meanwhile, look again (the newest committed
    state is what matters); the last look is reported as it is, with those files as ``gone``."""
    directory = os.fspath(directory)
    check_workers(workers)
    for _ in range(_ATTEMPTS):
        report = _verify_once(directory, workers)
        if not report.gone:
            break
    return report


def _verify_once(directory: str, workers: int | None) -> VerifyReport:
    inventory = take_inventory(directory, skip_other_versions=True)
    manifest = inventory.manifest
    empty = not manifest.files() and not inventory.ignored and inventory.committed is None
    problems = [] if empty else _manifest_problems(directory)   # an empty directory is not damage
    entries = manifest.fulls + manifest.batches
    with concurrent.futures.ThreadPoolExecutor(workers or verify_workers()) as pool:
        results = list(pool.map(lambda e: _check(directory, e, manifest.run), entries))
    ok, gone, reach = [], [], {}
    for entry, (problem, last_good) in zip(entries, results):
        if problem is not None and problem.label == "MISSING" and \
                entry.file not in take_inventory(directory, skip_other_versions=True).manifest.files():
            gone.append(entry.file)
            continue
        if problem is None:
            ok.append(entry.file)
        else:
            problems.append(problem)
        reach[entry.file] = last_good
    problems += _inventory_problems(directory, inventory)
    return VerifyReport(directory, tuple(ok), tuple(n for n in ok if n in inventory.adopted), tuple(gone),
                        tuple(problems), _recoverable(manifest, reach), manifest.durable_step())


def _manifest_problems(directory: str) -> list:
    path = os.path.join(directory, MANIFEST_NAME)
    try:
        if read_manifest(directory) is None:
            return [Problem(path, "MISSING", "there is no manifest (the list is rebuilt from the files)")]
    except CorruptCheckpointError as exc:
        return [Problem(path, "CORRUPT", exc.problem)]
    return []


def _inventory_problems(directory: str, inventory) -> list:
    problems = []
    if inventory.foreign_manifest:
        problems.append(Problem(os.path.join(directory, MANIFEST_NAME), "FOREIGN",
                                "lists none of the checkpoint files here (another directory's manifest?); "
                                "the files were used instead"))
    problems += [Problem(os.path.join(directory, n), "MISSING", f"listed in {MANIFEST_NAME} but missing")
                 for n in inventory.missing]
    problems += [Problem(os.path.join(directory, n), label, f"not used: {why}") for n, why, label in inventory.ignored]
    return problems


def _check(directory: str, entry, run):
    """(Problem or None, the last step this file carries the chain to: full step, or the last
    record of a batch that verifies in order; None when nothing of it is usable)."""
    path = entry_path(directory, entry)   # (a batch on another drive: there)
    if not isinstance(entry, FullEntry):
        check_batch_device(directory, entry)   # a drive not mounted: refused by name, as a stripe's

    def check():
        if isinstance(entry, FullEntry):
            index, _ = load_full(path, check_stripes=True)
            check_entry(path, entry, index, os.path.getsize(path), run)
            return None, entry.step
        return _check_batch(path, entry, run)
    return checked(path, check)


def checked(path: str, check):
    """``check()`` — (Problem or None, last good step or None) — with the exceptions that mean a
    file is missing, of another version or damaged turned into that file's Problem."""
    try:
        return check()
    except FileNotFoundError as exc:
        return Problem(path, "MISSING", f"missing ({exc.strerror})"), None
    except VersionMismatchError as exc:
        return Problem(path, "VERSION", exc.problem), None
    except (CorruptCheckpointError, OSError, EOFError) as exc:
        return Problem(path, "CORRUPT", getattr(exc, "problem", None) or str(exc)), None


def _check_batch(path: str, entry, run):
    with BatchReader(path) as reader:
        if reader.index is not None:
            check_entry(path, entry, reader.index, reader.size, run)
        last_good = None
        for position, step in enumerate(reader.steps):
            if step != entry.first + position:
                break
            try:
                reader.read_record(position)
            except CorruptCheckpointError as exc:
                return Problem(path, "CORRUPT", exc.problem), last_good
            last_good = step
        if reader.index_error is not None:
            return Problem(path, "CORRUPT", reader.index_error.problem), last_good
        if last_good != entry.last:
            return Problem(path, "CORRUPT", f"holds steps {entry.first}..{last_good}, the manifest says "
                                            f"{entry.first}..{entry.last}"), last_good
    return None, last_good


def _recoverable(manifest: Manifest, reach: dict) -> tuple:
    """(full step, full file, last reachable step) for every full checkpoint that verifies."""
    out = []
    for full in sorted(manifest.fulls, key=lambda f: f.step):
        if reach.get(full.file) is None:
            continue
        last = full.step
        for batch in plan_chain(manifest, full.step):
            good = reach.get(batch.file)
            if good is None or good < batch.first:
                break
            last = good
            if good != batch.last:
                break
        out.append((full.step, full.file, last))
    return tuple(out)
