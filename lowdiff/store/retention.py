"""Retention: which full checkpoints and differential batches of a directory a commit keeps — the
policies (``KeepLast``, ``KeepEvery``, ``KeepAll``) and ``retain``, the one rule every store applies
(the main directory, each storage tier, each rank directory of a partitioned layout).

A policy only *chooses* entries; it never deletes. The store commits the manifest the policy
returns and only then deletes what that manifest stopped listing (naming it ``retired``), so a
crash at any point of a clean leaves every listed state loadable and the next start finishes the
deletions (docs/format.md, "What may be deleted").

Every policy keeps what the newest durable state needs: the newest full checkpoint, the batches
that continue it, and anything newer (entries still being completed). ``pinned`` names files
that must stay whatever the policy says (the local tier's files the drainer has not copied yet).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Set

from lowdiff.store.manifest import Manifest, chain_end, plan_chain


@dataclasses.dataclass(frozen=True)
class KeepLast:
    """Keep the newest ``n`` full checkpoints and every batch whose last step is after the oldest
    of them (so each kept full checkpoint still reaches the newest step)."""

    n: int = 2

    def __post_init__(self):
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"KeepLast(n={self.n!r}): n must be an int >= 1")

    def retain(self, manifest: Manifest, pinned: Set[str] = frozenset()) -> Manifest:
        return _keep(manifest, _last_files(manifest, self.n) | set(pinned))

    def describe(self) -> str:
        return f"keep-last {self.n}"


@dataclasses.dataclass(frozen=True)
class KeepEvery:
    """Keep the state after every ``k``-th step (steps k, 2k, 3k, ... that the tier holds) loadable
    — the newest full checkpoint at or before it and the batches from there up to it — plus what
    ``KeepLast(last)`` keeps. For evaluating the run at regular intervals."""

    k: int
    last: int = 2

    def __post_init__(self):
        for name in ("k", "last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KeepEvery({name}={value!r}): {name} must be an int >= 1")

    def retain(self, manifest: Manifest, pinned: Set[str] = frozenset()) -> Manifest:
        return _keep(manifest, _last_files(manifest, self.last) | _every_files(manifest, self.k) | set(pinned))

    def describe(self) -> str:
        return f"keep-every {self.k} steps, and the last {self.last}"


@dataclasses.dataclass(frozen=True)
class KeepAll:
    """Keep everything (no cleaning): storage grows with the run."""

    def retain(self, manifest: Manifest, pinned: Set[str] = frozenset()) -> Manifest:
        return manifest

    def describe(self) -> str:
        return "keep-all"


Policy = KeepLast | KeepEvery | KeepAll


def check_policy(name: str, policy) -> None:
    if not isinstance(policy, (KeepLast, KeepEvery, KeepAll)):
        raise TypeError(f"{name} must be lowdiff.KeepLast(n), KeepEvery(k, last=n) or KeepAll(), "
                        f"got {policy!r}")


def retain(policy: Policy, manifest: Manifest, pinned: Set[str] = frozenset(),
           complete: Callable[[list], Set[tuple]] | None = None) -> Manifest:
    """What a commit of ``manifest`` keeps: the one retention rule every store applies (the main
    directory, each tier, each rank directory of a partitioned layout). ``pinned``: files that stay
    whatever the policy says. ``complete(fulls) -> {(step, session)}``: in a rank directory of a
    partitioned layout, which full checkpoints belong to a complete set (``retain_sets``)."""
    if complete is None:
        return policy.retain(manifest, pinned)
    return retain_sets(policy, manifest, pinned, complete(manifest.fulls))


def cleans_at_batch_commit(policy: Policy, fulls: int) -> bool:
    """Whether a rank directory of a partitioned layout applies retention when it commits a batch
    while it lists ``fulls`` full checkpoints: shares kept while a newer set was incomplete may go
    once it completes, which can only matter once more full checkpoints are listed than the policy
    keeps anyway (``KeepLast(n)``: n; other policies: 1)."""
    return fulls > (policy.n if isinstance(policy, KeepLast) else 1)


def retain_sets(policy: Policy, manifest: Manifest, pinned: Set[str], complete: Set[tuple]) -> Manifest:
    """Retention in one rank's directory of a partitioned layout. ``policy`` chooses among the full
    checkpoints whose set is complete (``complete``: their (step, session)); a share of a set that
    is not complete (yet) stays when it is newer than the oldest full checkpoint the policy kept —
    its set may still complete and become the newest state — and goes when older (a set that never
    completed is not needed once newer complete ones exist), unless pinned."""
    done = dataclasses.replace(manifest, fulls=[f for f in manifest.fulls if (f.step, f.session) in complete])
    kept = policy.retain(done, pinned)
    oldest = min((f.step for f in kept.fulls), default=None)
    files = kept.files() | {f.file for f in manifest.fulls if (f.step, f.session) not in complete and
                            (oldest is None or f.step > oldest or f.file in pinned)}
    return _keep(manifest, files)


def follow(dropped: Manifest, live: Manifest) -> Manifest:
    """A rank directory a smaller run dropped (lowdiff.distributed.shareretention): ``dropped``
    keeping the full shares of the sets ``live`` (the live rank that holds it) lists, and the
    differential shares of their sessions after the oldest of them (each kept set's chain)."""
    kept = {(f.step, f.session) for f in live.fulls}
    fulls = [f for f in dropped.fulls if (f.step, f.session) in kept]
    oldest: dict = {}
    for full in fulls:
        oldest[full.session] = min(full.step, oldest.get(full.session, full.step))
    batches = [b for b in dropped.batches if b.session in oldest and b.last > oldest[b.session]]
    return dataclasses.replace(dropped, fulls=fulls, batches=batches)


def _keep(manifest: Manifest, files: set) -> Manifest:
    return dataclasses.replace(manifest, fulls=[f for f in manifest.fulls if f.file in files],
                               batches=[b for b in manifest.batches if b.file in files])


def _last_files(manifest: Manifest, n: int) -> set:
    """The newest ``n`` full checkpoints, anything newer than the oldest of them, and the batches
    after it: "keep the newest n", the one rule that decides it."""
    fulls = sorted(manifest.fulls, key=lambda f: f.step)
    if not fulls:
        return manifest.files()   # nothing to start from yet: nothing may go
    newest = fulls[-n:]
    oldest = newest[0].step
    # (A full checkpoint of an earlier session at the step a resumed session's base has is not newer.)
    return {f.file for f in newest} | {f.file for f in fulls if f.step > oldest} | \
        {b.file for b in manifest.batches if b.last > oldest}


def _every_files(manifest: Manifest, k: int) -> set:
    """For each multiple ``s`` of ``k`` some full checkpoint's chain reaches: the newest full
    checkpoint at or before ``s`` that reaches it, and its batches up to the one holding ``s``.

    A full checkpoint also answers for the multiples before the next newer one even where its
    chain does not reach them yet: files arrive out of step order (a full checkpoint is committed,
    or copied to a tier, before the batch that ends just before it), and the batch that makes
    ``s`` reachable must still find its full checkpoint there."""
    keep: set = set()
    covered: set = set()
    newer_step = None
    for full in sorted(manifest.fulls, key=lambda f: f.step, reverse=True):
        chain = plan_chain(manifest, full.step)
        end = chain_end(manifest, full.step, chain)
        if newer_step is not None and not any(b.last > full.step and b.first < newer_step
                                              for b in manifest.batches):
            end = max(end, newer_step - 1)   # the batches up to the newer full are still to come
        newer_step = full.step
        first_multiple = -(-max(full.step, k) // k) * k
        targets = [s for s in range(first_multiple, end + 1, k) if s not in covered]
        if not targets:
            continue
        covered.update(targets)
        keep.add(full.file)
        keep.update(b.file for b in chain if b.first <= max(targets))
    return keep
