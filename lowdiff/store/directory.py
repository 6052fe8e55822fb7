"""CheckpointStore: owns a checkpoint directory while a trainer writes it.

It holds the directory lock, is the only writer of the manifest, and applies retention (its policy,
through lowdiff.store.retention.retain). Every
manifest change is committed before any file it stops listing is deleted, and names those files
in its ``retired`` list: a crash at any point leaves a manifest that lists only complete files,
keeps everything the newest state needs, and says which leftovers may go. Nothing else is ever
deleted (docs/format.md, "What may be deleted"): files the manifest does not explain are adopted
when they verify and belong to this run, and left alone otherwise.
"""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import secrets
import threading
from collections.abc import Callable, Set

from lowdiff import faults
from lowdiff.errors import CheckpointLockedError
from lowdiff.store.inventory import take_inventory
from lowdiff.store.manifest import (
    BatchEntry,
    FullEntry,
    Manifest,
    RetiredEntry,
    diff_name,
    entry_path,
    full_name,
    write_manifest,
)
from lowdiff.store.retention import KeepLast, Policy, check_policy, cleans_at_batch_commit, retain
from lowdiff.store.stripes import StripeDevices, check_devices, check_stripe_dirs, remove_stripes

log = logging.getLogger("lowdiff")
LOCK_NAME = "LOCK"
DEFAULT_POLICY = KeepLast(2)


class CheckpointStore:
    # The fault point between two deletions of retired files (lowdiff.faults).
    clean_point = "retention"

    def __init__(self, directory: str, policy: Policy = DEFAULT_POLICY, complete=None,
                 pinned: Callable[[], Set[str]] | None = None, stripe_dirs=()):
        """``policy``: what retention keeps (lowdiff.store.retention). ``complete(fulls) -> {(step,
        session)}``: in a partitioned directory, which of this directory's full checkpoints belong
        to a complete set; retention then counts only those. ``pinned()``: files retention must
        keep whatever the policy says (a storage tier's files not copied yet). ``stripe_dirs``:
        directories on other devices that full checkpoints are striped over with this one
        (lowdiff.store.stripes; ``stripes`` is then their writer, else None)."""
        check_policy("policy", policy)
        self.directory = os.path.abspath(os.fspath(directory))
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise NotADirectoryError(f"{self.directory} is a file, not a checkpoint directory")
        make_durable_directory(self.directory)
        self._stripe_dirs = check_stripe_dirs(self.directory, stripe_dirs)
        self.stripes: StripeDevices | None = None
        self.policy = policy
        self.pinned = pinned
        self._complete = complete
        # Partitioned directories (lowdiff.distributed.partition): the step every share is durable at, given
        # this rank's manifest; and what runs after each commit (cleaning dropped ranks' shares).
        self.shares_durable = None
        self.after_commit: list = []
        self.session = secrets.token_hex(4)
        self._lock_fd = self._acquire_lock()
        self._mutex = threading.Lock()
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        """Reconcile the manifest with the files, delete what the committed manifest retired and
        temporary files of dead writers, and commit the view if it differs."""
        inventory = take_inventory(self.directory, devices=self._stripe_dirs)
        for note in inventory.notes:
            log.warning("lowdiff: %s", note)
        check_devices(self.directory, inventory.manifest)
        if self._stripe_dirs:   # created only now: a listed stripe's missing device was refused above
            for device in self._stripe_dirs:
                make_durable_directory(device)
            self.stripes = StripeDevices(self.directory, self._stripe_dirs)
        self.run = inventory.manifest.run or secrets.token_hex(8)
        if inventory.retired_present and inventory.committed is not None:
            # A striped checkpoint's stripes go first: once its file is gone nothing names them.
            committed = Manifest.from_json(inventory.committed, os.path.join(self.directory, "MANIFEST.json"))
            for entry in committed.retired:
                if entry.file in inventory.retired_present:
                    remove_stripes(self.directory, entry.stripes)
                    _unlink(entry_path(self.directory, entry))   # (a batch on another drive: there)
        for name in inventory.dead_temps:
            _unlink(os.path.join(self.directory, name))
        for path in self.stripes.dead_temps() if self.stripes is not None else ():
            _unlink(path)
        self.manifest = dataclasses.replace(inventory.manifest, run=self.run, retired=[])
        if inventory.changed and self.manifest.files():
            write_manifest(self.directory, self.manifest)

    # ------------------------------------------------------------------ lock
    def _acquire_lock(self) -> int:
        path = os.path.join(self.directory, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointLockedError(
                f"{self.directory} is being written by another trainer (pid {holder}); "
                f"two trainers cannot share one checkpoint directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def close(self) -> None:
        """Release the lock. Idempotent."""
        if self._lock_fd >= 0:
            os.ftruncate(self._lock_fd, 0)  # no live holder any more (see lock_holder)
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1
        if self.stripes is not None:
            self.stripes.close()

    # ------------------------------------------------------------------ names
    def full_path(self, step: int) -> str:
        return os.path.join(self.directory, full_name(step, self.session))

    def batch_path(self, first: int, last: int) -> str:
        """Where the next batch is written: this directory, or with striping the next device in
        turn (lowdiff.store.stripes); ``commit_batch`` lists it where it is."""
        where = self.stripes.batch_directory() if self.stripes is not None else self.directory
        return os.path.join(where, diff_name(first, last, self.session))

    # ------------------------------------------------------------------ commits
    def durable_step(self) -> int:
        """The newest step a resume reaches now; in a partitioned directory the step every share
        of a complete set is durable at (``shares_durable``), not this rank's alone."""
        with self._mutex:
            manifest = self.manifest
        return manifest.durable_step() if self.shares_durable is None else self.shares_durable(manifest)

    def newest_full_step(self, since: int = 0) -> int:
        """The step of the newest full checkpoint of this session a resume can start from (-1: none
        at or after step ``since``): committed, and in a partitioned directory with its set
        complete (which reads the other ranks' manifests: ``since`` spares that when no newer one
        of this rank could be)."""
        with self._mutex:
            fulls = [f for f in self.manifest.fulls if f.session == self.session and f.step >= since]
        if self._complete is not None and fulls:
            done = self._complete(fulls)
            fulls = [f for f in fulls if (f.step, f.session) in done]
        return max((f.step for f in fulls), default=-1)

    def latest_step(self) -> int:
        """The newest step any committed entry mentions (-1 for an empty directory)."""
        with self._mutex:
            return max([f.step for f in self.manifest.fulls] + [b.last for b in self.manifest.batches], default=-1)

    def commit_batch(self, first: int, last: int, path: str, nbytes: int) -> None:
        with self._mutex:
            where = os.path.dirname(os.path.abspath(path))
            entry = BatchEntry(first, last, os.path.basename(path), nbytes, self.session,
                               None if where == self.directory else where)
            manifest = dataclasses.replace(self.manifest, batches=self.manifest.batches + [entry])
            if self._complete is not None and cleans_at_batch_commit(self.policy, len(manifest.fulls)):
                # Shares kept while a newer set was incomplete may go once it completes.
                manifest = self._retain(manifest)
            self._commit(manifest)

    def commit_full(self, step: int, path: str, nbytes: int, base: bool, stripes: tuple = ()) -> None:
        """List a committed full checkpoint, then apply retention. ``base`` marks the first full
        checkpoint of this session: entries of earlier sessions past ``step`` belong to a timeline
        that was abandoned when training resumed at ``step``; they are dropped. ``stripes``: the
        files holding a striped checkpoint's payload (all durable before its file was)."""
        with self._mutex:
            entry = FullEntry(step, os.path.basename(path), nbytes, self.session, tuple(stripes))
            manifest = dataclasses.replace(self.manifest, fulls=self.manifest.fulls + [entry])
            if base:
                manifest = dataclasses.replace(
                    manifest, fulls=[f for f in manifest.fulls if f.session == self.session or f.step <= step],
                    batches=[b for b in manifest.batches if b.session == self.session or b.last <= step])
            self._commit(self._retain(manifest))

    def _retain(self, manifest: Manifest) -> Manifest:
        """What retention keeps of ``manifest`` (lowdiff.store.retention.retain). In a partitioned
        directory only complete sets count, and every newer share is kept too: a rank that died
        while writing its share of a newer set leaves the older complete sets loadable."""
        pinned = self.pinned() if self.pinned is not None else frozenset()
        return retain(self.policy, manifest, pinned, self._complete)

    def _commit(self, manifest: Manifest) -> None:
        """Commit ``manifest``; then delete the files it stopped listing, which it names as retired
        (so a crash before a deletion leaves the next trainer the permission to finish it)."""
        listed = manifest.files()
        retired = [RetiredEntry(e.file, e.nbytes, getattr(e, "stripes", ()), getattr(e, "dir", None))
                   for e in self.manifest.fulls + self.manifest.batches if e.file not in listed]
        manifest = dataclasses.replace(manifest, run=self.run, retired=retired)
        write_manifest(self.directory, manifest)
        faults.point("manifest-commit")
        self.manifest = manifest
        for entry in retired:
            remove_stripes(self.directory, entry.stripes, self.clean_point)   # first: the file names them
            _unlink(entry_path(self.directory, entry))
            faults.point(self.clean_point)
        for hook in self.after_commit:
            hook(manifest)

    def keep_only(self, choose) -> None:
        """Commit the manifest ``choose(manifest)`` returns (a subset of the entries) and then
        delete what it no longer lists, like retention; nothing happens when it keeps everything."""
        with self._mutex:
            manifest = choose(self.manifest)
            if manifest.files() != self.manifest.files():
                self._commit(manifest)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def lock_holder(directory: str) -> str | None:
    """The pid of a live trainer writing ``directory``, None when there is none. Reads the pid the
    lock holder wrote (a clean close empties it) and asks whether that process lives; it never
    takes the lock itself, so it cannot make a starting trainer fail."""
    try:
        with open(os.path.join(directory, LOCK_NAME), "rb") as f:
            text = f.read(64).decode(errors="replace").strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        return None
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return text


def make_durable_directory(path: str) -> None:
    """Create ``path`` and its missing parents, each made durable by an fsync of the directory that
    holds it: POSIX makes a new directory entry durable only through its parent, and a power loss
    could otherwise drop a directory whose files were all synced (a rank directory of a
    partitioned run, found by the crash-state explorer under tests/crashstates/)."""
    missing = []
    probe = path
    while not os.path.isdir(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    os.makedirs(path, exist_ok=True)
    for created in reversed(missing):
        fd = os.open(os.path.dirname(created), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
