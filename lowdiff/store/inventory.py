"""Reconciling the committed manifest with the files actually in a checkpoint directory.

The manifest is the source of truth for what a trainer may delete, but not for what exists: a
manifest restored from a backup, copied from another directory, or lost, must never make lowdiff
forget (let alone delete) valid checkpoint files. ``take_inventory`` returns the *view* every reader
and the trainer use (docs/format.md, "What may be deleted"):

- listed files that exist, as listed;
- unlisted checkpoint files whose index verifies, whose name agrees with their index and whose run
  is this directory's: *adopted*;
- unlisted files that do not verify or belong to another run: left alone, unused, reported;
- listed files that are missing: dropped from the view, reported;
- files the committed manifest retired (the trainer may delete them) and temporary files of dead
  writers, reported separately; only the lock holder acts on them.

It also checks that a file is what its entry says it is (``check_entry``).
"""
from __future__ import annotations

import dataclasses
import os
import re

from lowdiff.errors import CorruptCheckpointError, DirectoryBusyError, ForeignFileError, VersionMismatchError
from lowdiff.format import container
from lowdiff.format.schema import FullIndex
from lowdiff.store.manifest import DIFF_RE, FULL_RE, MANIFEST_NAME, BatchEntry, FullEntry, Manifest, entry_path
from lowdiff.store.rankdirs import RANK_DIR_RE

# Temporary names written by fastio.Writer (".NAME.tmp-PID-RAND", for checkpoint files, the
# manifest, the tier marker and the controller's measurements) and by lowdiff before the manifest
# went through fastio ("MANIFEST.json.tmp-PID").
TEMP_RE = re.compile(r"^\.((?:full|diff)-[0-9a-f-]+\.ld[fd]|MANIFEST\.json|TIERS\.json|CONTROLLER\.json|DRIVE\.json)"
                     r"\.tmp-(\d+)-[0-9a-f]+$"
                     r"|^MANIFEST\.json\.tmp-(\d+)$")
_READ_ATTEMPTS = 5


@dataclasses.dataclass(frozen=True)
class Inventory:
    manifest: Manifest                 # the view: what readers use and the trainer commits next
    committed: bytes | None            # MANIFEST.json's bytes as read (None: missing)
    adopted: tuple = ()                # names of unlisted files taken into the view
    missing: tuple = ()                # names listed in the manifest that do not exist (damage)
    superseded: tuple = ()             # missing too, but the manifest is older than the files
                                       # (a stale manifest): retired by a commit that was lost
    foreign_manifest: bool = False     # MANIFEST.json lists none of the files here
    ignored: tuple = ()                # (name, why, label) of checkpoint-named files left unused;
                                       # label: "VERSION", "FOREIGN" (another run) or "CORRUPT"
    retired_present: tuple = ()        # names the committed manifest retired and that still exist
    dead_temps: tuple = ()             # temporary files whose writer process is gone
    notes: tuple = ()                  # what to warn about, one line each

    @property
    def changed(self) -> bool:
        """Whether the view differs from the committed manifest (the trainer then commits it)."""
        return self.committed is None or self.manifest.rebuilt or bool(self.adopted or self.missing or
                                                                        self.superseded)


def take_inventory(directory: str, *, skip_other_versions: bool = False, devices=()) -> Inventory:
    """The reconciled view of ``directory`` (see the module doc). Retries while a live trainer
    replaces the manifest underneath; raises DirectoryBusyError if it never holds still.

    A checkpoint file of another format version raises VersionMismatchError, unless
    ``skip_other_versions`` (an older state was asked for explicitly): then it is left unused with
    a note. ``devices``: the other drives' directories (a trainer's ``stripe_dirs``), whose
    unlisted batches of this run are adopted too (docs/format.md, "Differential batches on the
    drives")."""
    for _ in range(_READ_ATTEMPTS):
        before = _manifest_bytes(directory)
        names = _regular_files(directory)
        after = _manifest_bytes(directory)
        if before == after:
            return _reconcile(directory, before, names, skip_other_versions, tuple(devices))
    raise DirectoryBusyError(f"{directory}: the manifest changed {_READ_ATTEMPTS} times while it was read; "
                             f"a trainer is committing checkpoints right now — try again")


def _manifest_bytes(directory: str) -> bytes | None:
    try:
        with open(os.path.join(directory, MANIFEST_NAME), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _regular_files(directory: str) -> dict:
    """{name: size} of the regular files (directories and the like are never ours)."""
    out = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            try:
                if entry.is_file():
                    out[entry.name] = entry.stat().st_size
            except FileNotFoundError:
                pass
    return out


def _reconcile(directory: str, data: bytes | None, sizes: dict, skip_other_versions: bool,
               devices: tuple = ()) -> Inventory:
    notes: list = []
    committed = None
    if data is not None:
        path = os.path.join(directory, MANIFEST_NAME)
        try:
            committed = Manifest.from_json(data, path)
        except ForeignFileError:
            raise
        except CorruptCheckpointError as exc:
            notes.append(f"{exc}; rebuilding the list of checkpoints from the files in {directory}")
    checkpoint_names = [n for n in sizes if FULL_RE.match(n) or DIFF_RE.match(n)]
    dead_temps = tuple(n for n in sizes if is_dead_temp(n))
    foreign = committed is not None and bool(checkpoint_names) and bool(committed.files()) and \
        not committed.files() & set(checkpoint_names) and \
        (committed.run is None or committed.run != _newest_run(directory, checkpoint_names))
    if foreign:  # (the same run's manifest listing none of the files is merely stale: adopted below)
        notes.append(f"{os.path.join(directory, MANIFEST_NAME)} lists none of the {len(checkpoint_names)} "
                     f"checkpoint files in {directory} (a manifest of another directory?); "
                     f"rebuilt the list from the files")
        committed = None
    if committed is None:
        if data is None and checkpoint_names:
            notes.append(f"{os.path.join(directory, MANIFEST_NAME)} is missing; rebuilt it from the files")
        run = _newest_run(directory, checkpoint_names)
        view, adopted, ignored = _adopt(directory, Manifest(run=run), checkpoint_names, sizes, skip_other_versions)
        view = dataclasses.replace(view, rebuilt=True)
        view, adopted = _adopt_on_devices(view, devices, adopted, notes)
        notes += [f"{os.path.join(directory, name)} is not used: {why}" for name, why, _ in ignored]
        return Inventory(view, data, tuple(adopted), (), (), foreign, tuple(ignored), (), dead_temps, tuple(notes))
    retired_present = tuple(r.file for r in committed.retired
                            if r.file not in committed.files() and _size(directory, r, sizes) == r.nbytes)
    listed = committed.files()
    present = {e.file for e in committed.fulls + committed.batches if _size(directory, e, sizes) is not None}
    missing = sorted(name for name in listed if name not in present)
    view = dataclasses.replace(committed, fulls=[f for f in committed.fulls if f.file in present],
                               batches=[b for b in committed.batches if b.file in present], retired=[])
    view, skipped = _without_other_versions(directory, view, skip_other_versions)
    unlisted = [n for n in checkpoint_names if n not in listed and n not in retired_present]
    view, adopted, ignored = _adopt(directory, view, unlisted, sizes, skip_other_versions)
    view, adopted = _adopt_on_devices(view, devices, adopted, notes, set(listed) | set(retired_present))
    superseded: list = []
    if adopted:
        shown = ", ".join(adopted[:4]) + (" ..." if len(adopted) > 4 else "")
        if _commit_interrupted(committed, adopted, missing):
            notes.append(f"{directory}: {len(adopted)} checkpoint file{'s' if len(adopted) > 1 else ''} written "
                         f"after the last commit of {MANIFEST_NAME} verif{'y' if len(adopted) > 1 else 'ies'} "
                         f"(the process stopped between writing {'them' if len(adopted) > 1 else 'it'} and "
                         f"listing {'them' if len(adopted) > 1 else 'it'}); using {shown}")
        else:
            notes.append(f"{directory}: {len(adopted)} checkpoint files that {MANIFEST_NAME} does not list verify "
                         f"and belong to this run, more or older than a stopped commit leaves (was the "
                         f"manifest put back from a copy?); using them: {shown}")
        # A stale manifest lists files that newer commits, now lost, retired: not damage.
        newest_adopted = max((f.step for f in view.fulls if f.file in adopted), default=-1)
        superseded = [n for n in missing if _step_order(n)[0] < newest_adopted]
        missing = [n for n in missing if n not in superseded]
        if superseded:
            notes.append(f"{directory}: {len(superseded)} files the stale {MANIFEST_NAME} lists are gone, "
                         f"superseded by the newer files")
    paths = {e.file: entry_path(directory, e) for e in committed.fulls + committed.batches}
    for name in missing:
        notes.append(f"{paths[name]} is listed in {MANIFEST_NAME} but missing")
    ignored += skipped
    notes += [f"{os.path.join(directory, name)} is not used: {why}" for name, why, _ in ignored]
    if view.run is None:  # a manifest written before runs existed
        view = dataclasses.replace(view, run=_newest_run(directory, sorted(view.files())))
    return Inventory(view, data, tuple(adopted), tuple(missing), tuple(superseded), False, tuple(ignored),
                     retired_present, dead_temps, tuple(notes))


def _size(directory: str, entry, sizes: dict) -> int | None:
    """The size of an entry's file (None: it is not there). A batch on another drive whose
    directory does not exist counts as there (-1): a drive not mounted is refused by name where
    the batch is used or a trainer starts (lowdiff.store.stripes), never dropped as missing."""
    where = getattr(entry, "dir", None)
    if where is None:
        return sizes.get(entry.file)
    if not os.path.isdir(where):
        return -1
    try:
        return os.stat(os.path.join(where, entry.file)).st_size
    except FileNotFoundError:
        return None


def _adopt_on_devices(view: Manifest, devices: tuple, adopted: list, notes: list, taken=frozenset()):
    """``view`` with the unlisted batches of the other drives' ``devices`` adopted: those whose
    index verifies and whose run is ``view``'s (a drive may hold other runs' files: left alone,
    silently; damaged ones with a note). Their entries carry ``dir``."""
    if not devices or view.run is None:
        return view, adopted
    batches, adopted = list(view.batches), list(adopted)
    for device in devices:
        try:
            sizes = _regular_files(device)
        except FileNotFoundError:
            continue
        for name in sorted((n for n in sizes if DIFF_RE.match(n) and n not in taken), key=_step_order):
            path = os.path.join(device, name)
            try:
                entry, run = _describe(path, name, sizes[name])
            except (CorruptCheckpointError, VersionMismatchError, OSError, EOFError) as exc:
                notes.append(f"{path} is not used: {getattr(exc, 'problem', None) or exc}")
                continue
            if entry is not None and run == view.run:
                batches.append(dataclasses.replace(entry, dir=device))
                adopted.append(name)
    return dataclasses.replace(view, batches=batches), adopted


def _without_other_versions(directory: str, view: Manifest, skip: bool):
    """``view`` without listed files of another format version (reads each preamble): raises
    VersionMismatchError for the first, unless ``skip``. Such files are then never touched."""
    skipped = []
    where = {e.file: entry_path(directory, e) for e in view.fulls + view.batches}
    for name in sorted(view.files(), key=_step_order):
        try:
            container.check_version(where[name])
        except VersionMismatchError as exc:
            if not skip:
                raise
            skipped.append((name, exc.problem, "VERSION"))
        except OSError:
            pass  # missing or unreadable: the full check reports it
    names = {name for name, *_ in skipped}
    return dataclasses.replace(view, fulls=[f for f in view.fulls if f.file not in names],
                               batches=[b for b in view.batches if b.file not in names]), skipped


def _adopt(directory: str, view: Manifest, names: list, sizes: dict, skip_other_versions: bool):
    """Add the files ``names`` that verify and belong to ``view.run`` to ``view``."""
    fulls, batches, adopted, ignored = list(view.fulls), list(view.batches), [], []
    for name in sorted(names, key=_step_order):
        path = os.path.join(directory, name)
        try:
            entry, run = _describe(path, name, sizes[name])
        except VersionMismatchError as exc:
            if not skip_other_versions:
                raise
            ignored.append((name, exc.problem, "VERSION"))
            continue
        except (CorruptCheckpointError, OSError, EOFError) as exc:
            ignored.append((name, getattr(exc, "problem", None) or str(exc), "CORRUPT"))
            continue
        if entry is None:
            ignored.append((name, "it holds no complete record", "CORRUPT"))
        elif view.run is not None and run is not None and run != view.run:
            ignored.append((name, f"it belongs to run {run}, this directory is run {view.run}", "FOREIGN"))
        else:
            (fulls if isinstance(entry, FullEntry) else batches).append(entry)
            adopted.append(name)
    fulls.sort(key=lambda f: f.step)
    return dataclasses.replace(view, fulls=fulls, batches=batches), adopted, ignored


def _commit_interrupted(committed: Manifest, adopted: list, missing: list) -> bool:
    """Whether the files ``committed`` does not list are what a process stopped mid-commit leaves:
    each writer thread (differential batches, full checkpoints) puts at most one file in place
    before the manifest lists it, so at most one of each, none older than what the manifest lists,
    and nothing listed gone. Anything else (a manifest put back from a copy) is worded apart."""
    newest = max([f.step for f in committed.fulls] + [b.last for b in committed.batches], default=-1)
    fulls = [n for n in adopted if FULL_RE.match(n)]
    batches = [n for n in adopted if DIFF_RE.match(n)]
    return (not missing and len(fulls) <= 1 and len(batches) <= 1
            and all(_step_order(n)[0] >= newest for n in fulls)
            and all(_step_order(n)[0] > newest for n in batches))


def _step_order(name: str) -> tuple[int, str]:
    m = FULL_RE.match(name) or DIFF_RE.match(name)
    assert m is not None, f"{name!r} is not a checkpoint file name"  # callers sort only those
    return int(m.group(1)), name


def _describe(path: str, name: str, nbytes: int):
    """(entry, run) for a checkpoint file from its own index; raises when it does not verify or
    its name disagrees with its index. A batch whose index is damaged is described by the records
    its scan finds (the valid prefix of a torn file); entry is None when there are none."""
    from lowdiff.format.batchfile import BatchReader

    if _is_share_file(path):
        return _describe_share(path, name, nbytes)
    if m := FULL_RE.match(name):
        index = _read_full_index(path)
        entry = FullEntry(index.step, name, nbytes, m.group(2), getattr(index, "stripes", ()))
        check_entry(path, entry, index, nbytes, None)
        return entry, index.run
    m = DIFF_RE.match(name)
    assert m is not None, f"{name!r} is not a checkpoint file name"  # callers describe only those
    with BatchReader(path) as reader:
        steps, index = reader.steps, reader.index
    if not steps:
        return None, None
    batch = BatchEntry(steps[0], steps[-1], name, nbytes, m.group(3))
    if index is not None:
        check_entry(path, batch, index, nbytes, None)
    elif steps[0] != int(m.group(1)):
        raise CorruptCheckpointError(path, f"its first record is step {steps[0]}, its name says {int(m.group(1))}")
    return batch, None if index is None else index.run


def _is_share_file(path: str) -> bool:
    """Whether ``path`` is a share file in a rank directory of a partitioned directory (only there
    are shares checkpoint files; anywhere else one is a file of the wrong kind)."""

    return bool(RANK_DIR_RE.match(os.path.basename(os.path.dirname(os.path.abspath(path))))) and \
        container.file_kind(path) in (container.KIND_FULL_SHARE, container.KIND_DIFF_SHARE)


def _describe_share(path: str, name: str, nbytes: int):
    """(entry, run) of a share file from its index (docs/format.md, "Partitioned directories"). A
    differential share whose index does not verify is not described by a scan, unlike a batch: the
    index alone says which parameters the share holds, so its records cannot be used without it."""
    from lowdiff.format.sharefile import read_share_index

    index = read_share_index(path)
    m = FULL_RE.match(name)
    if bool(m) != hasattr(index, "step"):
        raise CorruptCheckpointError(path, f"its name says {'full' if m else 'differential'} checkpoint share, "
                                           f"its preamble says otherwise")
    entry: FullEntry | BatchEntry
    if m:
        entry = FullEntry(index.step, name, nbytes, m.group(2), index.stripes)   # (a striped share's)
    else:
        m = DIFF_RE.match(name)
        assert m is not None, f"{name!r} is not a checkpoint file name"  # callers describe only those
        entry = BatchEntry(index.first, index.last, name, nbytes, m.group(3))
    check_entry(path, entry, index, nbytes, None)
    return entry, index.run


def _read_full_index(path: str):
    """The index of a full checkpoint, or of a full-checkpoint share in a rank directory."""
    from lowdiff.format.fullckpt import read_full_index

    if _is_share_file(path):
        from lowdiff.format.sharefile import read_share_index
        return read_share_index(path)
    return read_full_index(path)


def check_entry(path: str, entry, index, nbytes: int, run: str | None) -> None:
    """Raise CorruptCheckpointError unless the file at ``path`` (``nbytes`` long, its ``index``:
    FullIndex, BatchIndex, or None when unreadable) is what ``entry`` says: size, kind, steps,
    session and run."""
    problems = []
    if nbytes != entry.nbytes:
        problems.append(f"it is {nbytes} bytes, the manifest says {entry.nbytes}")
    if index is not None:
        full = isinstance(entry, FullEntry)
        # (a full-checkpoint share's index is not a FullIndex but has its ``step`` too)
        if full != (isinstance(index, FullIndex) or hasattr(index, "step")):
            problems.append(f"it is a {'full checkpoint' if not full else 'differential batch'}, the manifest "
                            f"lists a {'full checkpoint' if full else 'differential batch'}")
        steps = {"step": entry.step} if full else {"first": entry.first, "last": entry.last}
        wanted = {"session": entry.session, **steps}
        if run is not None and index.run is not None:
            wanted["run"] = run
        for key, value in wanted.items():
            if getattr(index, key, None) != value:
                problems.append(f"its {key} is {getattr(index, key, None)!r}, the manifest says {value!r}")
        if full and tuple(getattr(index, "stripes", ())) != tuple(entry.stripes):
            problems.append("its stripes are not the ones the manifest lists")
    if problems:
        raise CorruptCheckpointError(path, "is not the file the manifest lists (replaced or damaged): "
                                           + "; ".join(problems))


def _newest_run(directory: str, names: list) -> str | None:
    """The run of the newest checkpoint file among ``names`` that verifies and carries one (None
    if none does): without a manifest, the run a directory continues is the one its newest state
    belongs to. Every file kind carries it (full checkpoints, batches, shares), so a directory that
    lost its full checkpoints still proves its run by its batches."""
    for name in sorted(names, key=_step_order, reverse=True):
        path = os.path.join(directory, name)
        try:
            _, run = _describe(path, name, os.path.getsize(path))
        except (CorruptCheckpointError, VersionMismatchError, OSError, EOFError):
            continue
        if run is not None:
            return run
    return None


def is_dead_temp(name: str) -> bool:
    """Whether ``name`` is a temporary file of ours whose writer process is gone."""
    m = TEMP_RE.match(name)
    if not m:
        return False
    pid = int(m.group(2) or m.group(3))
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def load_view(directory: str, warn=None, **options) -> Manifest:
    """The reconciled view of ``directory``, its notes passed to ``warn``."""
    inventory = take_inventory(directory, **options)
    if warn:
        for note in inventory.notes:
            warn(note)
    return inventory.manifest

