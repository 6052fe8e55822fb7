"""An object-store shared tier (docs/format.md, "Shared tier in an object store"): ``BucketStore``,
what the drainer commits into (as it does into a directory's PolicyStore), and ``read_bucket`` /
``download``, what readers use. A file is in the bucket once a manifest object naming it with its
size and CRC-32C has been created with ``If-None-Match: *``; deletions come after that commit.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import secrets
import threading
import time
from typing import cast

from lowdiff import faults
from lowdiff.errors import CheckpointError, CorruptCheckpointError
from lowdiff.format.container import BucketManifest
from lowdiff.store.manifest import DIFF_RE, FULL_RE, Manifest
from lowdiff.store.retention import Policy, retain
from lowdiff.tiers.objectstore import ObjectStore, ObjectStoreError, S3Client, parse_s3_url
from lowdiff.tiers.policy import _with

__all__ = ["BucketStore", "download", "read_bucket", "remove_prefix", "stage"]

log = logging.getLogger("lowdiff")
MANIFEST_RE = re.compile(r"^MANIFEST-(\d{12})\.json$")


_READ_ATTEMPTS = 5


def manifest_name(seq: int) -> str:
    return f"MANIFEST-{seq:012d}.json"


def read_bucket(client: S3Client, listing: dict | None = None) -> BucketManifest | None:
    """The newest committed manifest of the bucket prefix (None: nothing committed). A newest
    manifest that does not parse is an error naming it (an older one is never used instead: the
    objects it names may be gone). A live writer deletes its older manifests after each commit:
    one listed but gone when read is listed again."""
    for attempt in range(_READ_ATTEMPTS):
        listing = client.listing() if listing is None else listing
        numbered = sorted(int(m.group(1)) for name in listing if (m := MANIFEST_RE.match(name)))
        if not numbered:
            return None
        name = manifest_name(numbered[-1])
        where = f"{client.url}/{name}"
        try:
            data = client.get(name)
        except ObjectStoreError as exc:
            if not exc.missing or attempt == _READ_ATTEMPTS - 1:
                raise
            listing = None
            continue
        committed = BucketManifest.from_json(data, where, Manifest)
        assert isinstance(committed.manifest, Manifest)
        if committed.seq != numbered[-1]:
            raise CorruptCheckpointError(where, f"holds commit number {committed.seq}")
        return committed
    raise AssertionError("unreachable")


def download(client: S3Client, committed: BucketManifest, name: str, path: str) -> None:
    """Stream the object ``name`` into ``path`` and check its size and CRC-32C against the
    committed manifest (CorruptCheckpointError naming the object; the partial file is removed)."""
    nbytes, crc = committed.objects[name]
    try:
        found_bytes, found_crc = client.download(name, path)
        if (found_bytes, found_crc) != (nbytes, crc):
            raise CorruptCheckpointError(f"{client.url}/{name}",
                                         f"is {found_bytes} bytes with CRC-32C {found_crc:#010x}; "
                                         f"its manifest says {nbytes} bytes, {crc:#010x}")
    except BaseException:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise


def stage(url: str, directory: str, worth=None, options: ObjectStore | None = None) -> tuple[Manifest | None, list]:
    """Copy what the newest commit of the bucket ``url`` lists into ``directory`` (a new, empty
    checkpoint directory) and commit its MANIFEST.json there, listing the files that arrived with
    the size and CRC-32C the commit names; a file that does not is left out with a warning (a
    resume then falls back as it does for a damaged file). Returns (the manifest committed there,
    [(object name, why)] of those left out); the manifest is None when nothing is committed, or
    ``worth(manifest)`` says the commit is not worth fetching (another tier reaches as far)."""
    from lowdiff.store.manifest import write_manifest

    client = S3Client(parse_s3_url(url), options or ObjectStore())
    committed = read_bucket(client)
    if committed is None or (worth is not None and not worth(committed.manifest)):
        return None, []
    manifest = cast(Manifest, committed.manifest)
    arrived, problems = set(), []
    for name in sorted(committed.objects):
        try:
            download(client, committed, name, os.path.join(directory, name))
            arrived.add(name)
        except CorruptCheckpointError as exc:
            log.warning("lowdiff: %s; not used", exc)
            problems.append((name, str(exc)))
    manifest = dataclasses.replace(manifest, fulls=[f for f in manifest.fulls if f.file in arrived],
                                   batches=[b for b in manifest.batches if b.file in arrived], retired=[])
    write_manifest(directory, manifest)
    return manifest, problems


class BucketStore:
    """The shared tier's store in a bucket: the drainer's counterpart of PolicyStore. Call order:
    ``open`` (lists, reads the newest commit, cleans what a crashed writer left), then
    ``receive``/``commit_copied`` per file from the drainer thread, ``close`` at the end."""

    clean_point = "clean"

    def __init__(self, url: str, policy: Policy, options: ObjectStore | None = None, *, verify: bool = True,
                 complete=None, dropped=None, durable=None):
        """``complete``: a rank's prefix of a partitioned layout (``complete_in_bucket``): the policy
        counts complete sets only (lowdiff.store.retention.retain). ``dropped()``: the prefixes of
        ranks a smaller run dropped that this rank removes (``dropped_prefixes``), once a set of
        this session is complete. ``durable(manifest)``: the durable step of a partitioned layout, this
        rank's manifest given (``durable_in_bucket``)."""
        self.directory = url                 # what messages name (it is no directory)
        self._complete = complete
        self.url = parse_s3_url(url)
        self.policy = policy
        self.options = options or ObjectStore()
        self.verify = verify
        self.session = secrets.token_hex(4)
        self.run: str | None = None
        self.manifest = Manifest()
        self._objects: dict = {}             # name -> (nbytes, crc32c) of what the manifest lists
        self._uploaded: dict = {}            # uploaded, not yet committed
        self._seq = -1
        self._client: S3Client | None = None
        self._mutex = threading.Lock()
        self._find_dropped = dropped
        self._durable = durable
        self._durable_seen = -1
        self._dropped: list = []

    def open(self) -> None:
        """Read the newest commit and clean the prefix (see docs/format.md): abort unfinished
        multipart uploads, delete our objects the commit does not name and older manifests."""
        # A first contact that keeps failing (a wrong endpoint, a network that is down) gives up
        # sooner than an upload that has made progress: wrap() waits for it.
        probe = S3Client(self.url, dataclasses.replace(self.options, deadline_s=min(self.options.deadline_s, 20.0)))
        listing = probe.listing()
        client = S3Client(self.url, self.options)
        committed = read_bucket(client, listing)
        if committed is not None:
            self._seq, self.manifest, self._objects = committed.seq, cast(Manifest, committed.manifest), \
                dict(committed.objects)
        self.run = self.manifest.run or secrets.token_hex(8)
        for key, upload_id in client.uploads():
            client.abort(key, upload_id)
        stale = [name for name in listing if _ours(name) and name not in self._objects and
                 name != manifest_name(self._seq)]
        if stale:
            log.info("lowdiff: removing %d objects no commit of %s names (left by an earlier run)",
                     len(stale), self.url)
            client.delete(stale)
        self._dropped = list(self._find_dropped()) if self._find_dropped is not None else []
        self._client = client

    def close(self) -> None:
        self._client = None

    def listed(self) -> Manifest:
        with self._mutex:
            return self.manifest

    def durable_step(self) -> int:
        """The newest step a resume from the bucket alone reaches (its newest commit; partitioned:
        the furthest a complete set reaches by every rank's newest commit, or what it was when
        last read if the bucket cannot be read now); -1 before the first."""
        with self._mutex:
            manifest = self.manifest
        if self._durable is None:
            return manifest.durable_step()
        try:
            self._durable_seen = self._durable(manifest)
        except (CheckpointError, OSError) as exc:
            log.info("lowdiff: the shared tier's durable step is not updated: %s", exc)
        return self._durable_seen

    def would_keep(self, entry) -> bool:
        with self._mutex:
            return entry.file in retain(self.policy, _with(self.manifest, entry), frozenset(), self._complete).files()

    def clean(self) -> None:
        """Nothing pins objects in the bucket: retention runs at each commit."""

    # ------------------------------------------------------------ drainer thread
    def receive(self, source: str, entry, timings: dict) -> int:
        """Upload the local file ``source`` as ``entry.file`` (not listed until ``commit_copied``);
        returns its size. With ``verify`` the object is read back and checked."""
        client = self._require()
        started = time.perf_counter()
        nbytes, crc = client.upload_file(source, entry.file)
        faults.point("drain-write")
        copied = time.perf_counter()
        if self.verify:
            self._read_back(client, entry.file, nbytes, crc)
        timings["copy_s"] = timings.get("copy_s", 0.0) + copied - started
        timings["verify_s"] = timings.get("verify_s", 0.0) + time.perf_counter() - copied
        with self._mutex:
            self._uploaded[entry.file] = (nbytes, crc)
        return nbytes

    def _read_back(self, client: S3Client, name: str, nbytes: int, crc: int) -> None:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="lowdiff-s3-verify-") as scratch:
            download(client, BucketManifest(-1, Manifest(), {name: (nbytes, crc)}), name, os.path.join(scratch, name))

    def commit_copied(self, entry) -> None:
        """List ``entry`` (uploaded by ``receive``) with retention applied: a new manifest object,
        created only if its number is free; then delete what it no longer names."""
        client = self._require()
        with self._mutex:
            manifest = retain(self.policy, _with(self.manifest, entry), frozenset(), self._complete)
            known = {**self._objects, **self._uploaded}
            objects = {name: known[name] for name in manifest.files()}
            seq = self._seq + 1
            body = BucketManifest(seq, _run(manifest, self.run), objects).to_json()
        try:
            client.put(manifest_name(seq), body, if_none_match=True)
        except OSError as exc:
            if "PreconditionFailed" not in str(exc) and "412" not in str(exc):
                raise
            # Our own put may have landed with its answer lost (the retry is then refused): ours
            # if the bytes are ours; another writer's otherwise.
            if client.get(manifest_name(seq)) != body:
                raise CheckpointError(f"{self.url}: commit {seq} exists already: another writer drains into "
                                      f"this prefix; one trainer per shared tier") from exc
        faults.point("manifest-commit")
        with self._mutex:
            dropped = set(self._objects) | set(self._uploaded)
            self._seq, self.manifest, self._objects = seq, _run(manifest, self.run), objects
            self._uploaded = {}
            dropped -= set(objects)
        for name in sorted(dropped):
            client.delete([name])
            faults.point(self.clean_point)
        client.delete([manifest_name(seq - 1)] if seq > 0 else [])
        self._remove_dropped()

    def _remove_dropped(self) -> None:
        """Remove the dropped ranks' prefixes once this session has a complete set (every rank's
        newest commit lists its share; never before: the dropped prefixes' shares may be the only
        copy of the newest complete set) and this prefix's commit lists no set of an earlier
        session (those are the sets that need the dropped shares: retention drops them once a set
        of this session is complete, as ``complete_in_bucket`` counts them incomplete, but only at
        its next commit; while this prefix lists one, the dropped prefixes stay)."""
        if not self._dropped or self._complete is None:
            return
        with self._mutex:
            fulls = list(self.manifest.fulls)
        done = self._complete(fulls)
        if not done or {f.session for f in fulls} != {session for _, session in done}:
            return
        while self._dropped:
            remove_prefix(self._dropped[0], self.options)
            self._dropped.pop(0)

    def _require(self) -> S3Client:
        if self._client is None:
            raise CheckpointError(f"{self.url} is not open")
        return self._client


def remove_prefix(url: str, options: ObjectStore | None) -> None:
    """Delete the prefix of a dropped rank, crash-safely: its manifest objects first, oldest first
    (once they are gone nothing in it is committed: readers pass it over), then its unfinished
    uploads and the objects of ours they named. A crash in between leaves objects no commit names,
    which the next run that finds the prefix removes; objects that are not ours stay (with a
    warning), as in a directory."""
    client = S3Client(parse_s3_url(url), options or ObjectStore())
    listing = client.listing()
    for seq in sorted(int(m.group(1)) for name in listing if (m := MANIFEST_RE.match(name))):
        client.delete([manifest_name(seq)])
        faults.point("dropped-prefix")
    for key, upload_id in client.uploads():
        client.abort(key, upload_id)
    for name in sorted(name for name in listing if _ours(name) and not MANIFEST_RE.match(name)):
        client.delete([name])
        faults.point("dropped-prefix")
    others = sorted(name for name in listing if not _ours(name))
    if others:
        log.warning("lowdiff: %s, the prefix of a rank this run dropped, holds objects lowdiff did not write (%s); "
                    "they are left in place", url, ", ".join(others[:4]) + (" ..." if len(others) > 4 else ""))
    log.info("lowdiff: removed %s, the prefix of a rank this run dropped", url)


def _ours(name: str) -> bool:
    return bool(FULL_RE.match(name) or DIFF_RE.match(name) or MANIFEST_RE.match(name))


def _run(manifest: Manifest, run: str | None) -> Manifest:
    return dataclasses.replace(manifest, run=run, retired=[])
