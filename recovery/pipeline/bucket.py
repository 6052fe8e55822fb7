"""Restoring from a bucket's newest commit (an object-store shared tier; recovery.tiers decides
when): its frozen plan, by the commit's manifest, and ``BucketLayout``, how recovery.execute reads
it. A candidate's full checkpoint is fetched and loaded while the first batch files of its chain
arrive (lowdiff.tiers.fetch); the replay starts with the first (recovery.pipeline.streamed), the
later ones fetched a few ahead. Everything said of an object names its s3:// URL, never the
temporary directory it was fetched into.
"""
from __future__ import annotations

import contextlib
import logging
import os

from lowdiff.errors import CorruptCheckpointError, NoCheckpointError
from lowdiff.format.batchfile import BatchReader
from lowdiff.format.fullckpt import load_full
from lowdiff.store.inventory import check_entry
from lowdiff.store.manifest import chain_end, describe_retained, plan_chain
from lowdiff.tiers.bucket import read_bucket
from lowdiff.tiers.fetch import BucketFetch
from lowdiff.tiers.objectstore import ObjectStore, ObjectStoreError, S3Client, parse_s3_url
from recovery.execute import Restored, execute
from recovery.pipeline.replay import replay
from recovery.pipeline.streamed import StreamedChain
from recovery.plan import Candidate, Loaded, Plan, warn

__all__ = ["BucketLayout", "BucketSource", "ObjectStoreError", "open_bucket", "unreachable", "urls_named"]


def open_bucket(url: str, staging: str, options) -> BucketSource:
    """The bucket ``url``'s newest commit, and a fetcher into ``staging`` (a new directory)."""
    client = S3Client(parse_s3_url(url), options or ObjectStore())
    return BucketSource(url, staging, client, read_bucket(client))


class BucketSource:
    """A bucket's newest commit as a tier to restore (``restore``: plan, then recovery.execute
    with ``BucketLayout``); its objects are fetched into ``staging`` as the restore asks for them.
    Everything said of them names their s3:// URL, never the staging path."""

    def __init__(self, url: str, staging: str, client, committed):
        self.url, self.staging, self.committed = url, staging, committed
        self.fetch = BucketFetch(client, committed, staging, threads=client.options.max_concurrency) \
            if committed is not None else None

    def named(self, text: str) -> str:
        return text.replace(os.path.join(self.staging, ""), f"{self.url}/")

    def warn(self, message: str) -> None:
        warn(self.named(message))

    def restore(self, *, check_full, stop_step: int | None, apply_full, params_for, optimizer_for, workers=None,
                into=None) -> Restored | None:
        plan = self.plan(stop_step)
        if plan is None:
            return None
        restored, _ = execute(plan, BucketLayout(self, check_full, into, workers), apply_full=apply_full,
                              params_for=params_for, optimizer_for=optimizer_for)
        return restored

    def plan(self, stop_step: int | None) -> Plan | None:
        """The frozen plan of the commit, by its manifest (the objects are checked as they arrive)."""
        if self.committed is None:
            return None
        manifest = self.committed.manifest
        if stop_step is not None and not manifest.retains(stop_step):
            raise NoCheckpointError(f"{self.url}: step {stop_step} is not retained; {describe_retained(manifest)}")
        fulls = sorted((f for f in manifest.fulls if stop_step is None or f.step <= stop_step),
                       key=lambda f: f.step, reverse=True)
        candidates = tuple(Candidate(f.step, f, chain_end(manifest, f.step, plan_chain(manifest, f.step)))
                           for f in fulls)
        if not candidates:
            return None
        if stop_step is not None and candidates[0].reach < stop_step:
            raise NoCheckpointError(f"{self.url}: step {stop_step} cannot be rebuilt: the files after the full "
                                    f"checkpoint of step {candidates[0].step} reach only step {candidates[0].reach}")
        return Plan("bucket", self.url, stop_step, candidates, manifest.durable_step(), view=self.committed)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.fetch is not None:
            self.fetch.close()
        return False


class BucketLayout:
    """How recovery.execute reads a bucket's commit: a candidate's full checkpoint is fetched and
    loaded, its chain is fetched while the replay runs (recovery.pipeline.streamed). With a target
    step, the chain is fetched and checked before the full checkpoint is loaded, so a target its
    files do not reach is refused before any live object changes."""

    def __init__(self, source: BucketSource, check_full, into, workers: int | None):
        assert source.fetch is not None, "a bucket with a commit has a fetcher"
        self.source, self.fetch, self._check_full, self._into, self._workers = \
            source, source.fetch, check_full, into, workers

    def load(self, plan: Plan, position: int, skipped: list) -> Loaded | None:
        fetch, full, manifest = self.fetch, plan.candidates[position].source, plan.view.manifest
        entries = [e for e in plan_chain(manifest, full.step) if plan.target is None or e.first <= plan.target]
        fetch.expect([full.file] + [e.file for e in entries])
        chain = StreamedChain(entries, full.step, self._arrive, lambda e: fetch.url(e.file), self.source.warn,
                              fatal=unreachable)
        where = fetch.url(full.file)
        why = None
        try:
            if plan.target is not None and (reach := chain.reach()) < plan.target:
                why = f"the files after the full checkpoint {where} reach only step {reach}"
            else:
                path = fetch.wait(full.file)

                def check(index, outline) -> None:
                    check_entry(where, full, index, os.path.getsize(path), manifest.run)
                    self._check_full(where, index, outline)
                index, state = load_full(path, into=self._into() if self._into is not None else None, check=check)
        except (CorruptCheckpointError, OSError, EOFError, LookupError) as exc:
            if unreachable(exc):
                chain.close()
                raise
            why = self.source.named(f"full checkpoint {where} does not verify ({exc})")
        except BaseException:
            chain.close()
            raise
        if why is not None:
            chain.close()
            skipped.append((full.file, why))
            warn(f"lowdiff: {why}; falling back to an older one")
            return None
        return Loaded(index, state, full.file, (chain,))

    def _arrive(self, entry) -> BatchReader:
        where = self.fetch.url(entry.file)
        reader = BatchReader(self.fetch.wait(entry.file))
        reader.path = where    # what its messages name from now on
        if reader.index is not None:
            try:
                check_entry(where, entry, reader.index, reader.size, self.source.committed.manifest.run)
            except BaseException:
                reader.close()
                raise
        return reader

    def replay(self, plan: Plan, candidate: Candidate, loaded: Loaded, params: list, optimizer, times) -> tuple:
        return replay(loaded.chain[0].pairs, candidate.step, params, optimizer, stop_step=plan.target,
                      warn=self.source.warn, times=times, workers=self._workers)

    def release(self, loaded: Loaded) -> None:
        loaded.chain[0].close()

    def none_verifies(self, plan: Plan, skipped: list) -> Exception:
        return NoCheckpointError(f"{plan.directory}: no full checkpoint verifies" +
                                 (f" at or before step {plan.target}" if plan.target is not None else "") +
                                 ": " + "; ".join(why for _, why in skipped))


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the store could not be reached or refused us (after the client's
    retries), not that an object is missing or damaged: resume then fails with it instead of
    passing the object over (an older state resumed on would drop the bucket's newer commits)."""
    return isinstance(exc, ObjectStoreError) and not exc.missing


class _Named(logging.Filter):
    def __init__(self, roots, url: str):
        super().__init__()
        self.roots, self.url = roots, url

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if any(root in text for root in self.roots):
            for root in self.roots:
                text = text.replace(os.path.join(root, ""), f"{self.url}/").replace(root, self.url)
            record.msg, record.args = text, ()
        return True


@contextlib.contextmanager
def urls_named(roots, url: str):
    """While restoring from ``roots`` (directories a bucket's commits were fetched into: this
    rank's, and rank 0's, which plans for every rank), lowdiff's log records name ``url``."""
    named = _Named(tuple(roots), url)
    logging.getLogger("lowdiff").addFilter(named)
    try:
        yield
    finally:
        logging.getLogger("lowdiff").removeFilter(named)
