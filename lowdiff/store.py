"""CheckpointStore: owns a checkpoint directory while a trainer writes it.

It holds the directory lock, is the only writer of the manifest, and applies retention. Every
manifest change is committed before any file it stops listing is deleted, so a crash at any point
leaves a manifest that lists only complete files and keeps everything the newest state needs.
"""
from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import secrets
import threading

from .errors import CheckpointLockedError
from .manifest import (DIFF_RE, FULL_RE, MANIFEST_NAME, BatchEntry, FullEntry, Manifest, diff_name,
                       full_name, load_manifest, write_manifest)

log = logging.getLogger("lowdiff")
LOCK_NAME = "LOCK"


class CheckpointStore:
    def __init__(self, directory: str, keep_full: int = 2):
        if keep_full < 1:
            raise ValueError(f"keep_full={keep_full} must be >= 1")
        self.directory = os.path.abspath(os.fspath(directory))
        os.makedirs(self.directory, exist_ok=True)
        self.keep_full = keep_full
        self.session = secrets.token_hex(4)
        self._lock_fd = self._acquire_lock()
        self._mutex = threading.Lock()
        self.manifest = load_manifest(self.directory, warn=log.warning)
        if self.manifest.rebuilt and (self.manifest.fulls or self.manifest.batches):
            write_manifest(self.directory, self.manifest)
        self._remove_strays(delete_unlisted=not self.manifest.rebuilt)

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
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = -1

    # ------------------------------------------------------------------ names
    def full_path(self, step: int) -> str:
        return os.path.join(self.directory, full_name(step, self.session))

    def batch_path(self, first: int, last: int) -> str:
        return os.path.join(self.directory, diff_name(first, last, self.session))

    # ------------------------------------------------------------------ commits
    def durable_step(self) -> int:
        with self._mutex:
            return self.manifest.durable_step()

    def latest_step(self) -> int:
        """The newest step any committed entry mentions (-1 for an empty directory)."""
        with self._mutex:
            return max([f.step for f in self.manifest.fulls] + [b.last for b in self.manifest.batches], default=-1)

    def commit_batch(self, first: int, last: int, path: str, nbytes: int) -> None:
        with self._mutex:
            entry = BatchEntry(first, last, os.path.basename(path), nbytes, self.session)
            self._commit(dataclasses.replace(self.manifest, batches=self.manifest.batches + [entry]))

    def commit_full(self, step: int, path: str, nbytes: int, base: bool) -> None:
        """List a committed full checkpoint, then apply retention. ``base`` marks the first full
        checkpoint of this session: entries of earlier sessions past ``step`` belong to a timeline
        that was abandoned when training resumed at ``step``; they are dropped."""
        with self._mutex:
            entry = FullEntry(step, os.path.basename(path), nbytes, self.session)
            manifest = Manifest(self.manifest.fulls + [entry], list(self.manifest.batches))
            if base:
                manifest = Manifest(
                    [f for f in manifest.fulls if f.session == self.session or f.step <= step],
                    [b for b in manifest.batches if b.session == self.session or b.last <= step])
            self._commit(self._retain(manifest))

    def _retain(self, manifest: Manifest) -> Manifest:
        """Keep the newest ``keep_full`` full checkpoints and the batches that continue them."""
        kept = sorted(manifest.fulls, key=lambda f: f.step)[-self.keep_full:]
        if not kept:
            return manifest
        oldest = kept[0].step
        return Manifest([f for f in manifest.fulls if f in kept],
                        [b for b in manifest.batches if b.last > oldest])

    def _commit(self, manifest: Manifest) -> None:
        old = self.manifest
        write_manifest(self.directory, manifest)
        self.manifest = manifest
        listed = {f.file for f in manifest.fulls} | {b.file for b in manifest.batches}
        for name in {f.file for f in old.fulls} | {b.file for b in old.batches}:
            if name not in listed:
                _unlink(os.path.join(self.directory, name))

    def _remove_strays(self, delete_unlisted: bool) -> None:
        """Delete temp files, and checkpoint files a trusted manifest does not list (left by a
        crash between a manifest commit and an unlink). Safe because we hold the lock: no other
        writer can be mid-commit. Files left out of a rebuilt manifest failed to verify; they are
        kept for inspection."""
        listed = {f.file for f in self.manifest.fulls} | {b.file for b in self.manifest.batches}
        for name in os.listdir(self.directory):
            stray_temp = name.startswith(".") and ".tmp-" in name or name.startswith(MANIFEST_NAME + ".tmp-")
            unlisted = delete_unlisted and (FULL_RE.match(name) or DIFF_RE.match(name)) and name not in listed
            if stray_temp or unlisted:
                _unlink(os.path.join(self.directory, name))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
