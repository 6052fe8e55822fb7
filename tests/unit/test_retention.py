"""Retention policies (lowdiff.store.retention): what each keeps, exactly, on hand-built manifests."""
from __future__ import annotations

import pytest

from lowdiff.store.manifest import BatchEntry, FullEntry, Manifest, diff_name, full_name
from lowdiff.store.retention import KeepAll, KeepEvery, KeepLast


def full(step, session="aaaaaaaa"):
    return FullEntry(step, full_name(step, session), 100 + step, session)


def batch(first, last, session="aaaaaaaa"):
    return BatchEntry(first, last, diff_name(first, last, session), 10, session)


def run(full_steps, batch_spans) -> Manifest:
    return Manifest([full(s) for s in full_steps], [batch(a, b) for a, b in batch_spans], run="0" * 16)


def kept(manifest: Manifest) -> tuple:
    return sorted(f.step for f in manifest.fulls), sorted((b.first, b.last) for b in manifest.batches)


# fulls every 4 steps, batches of 2 steps, up to step 14
M = run([0, 4, 8, 12], [(1, 2), (3, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 14)])


def test_keep_last_keeps_the_newest_n_fulls_and_the_batches_after_the_oldest():
    assert kept(KeepLast(2).retain(M)) == ([8, 12], [(9, 10), (11, 12), (13, 14)])
    assert kept(KeepLast(1).retain(M)) == ([12], [(13, 14)])
    assert kept(KeepLast(9).retain(M)) == kept(M)


def test_keep_every_keeps_each_multiple_loadable_from_the_newest_full_before_it():
    # multiples of 5: 5 (from full 4, batch 5-6), 10 (full 8, batch 9-10); last 1: full 12 + 13-14
    assert kept(KeepEvery(5, last=1).retain(M)) == ([4, 8, 12], [(5, 6), (9, 10), (13, 14)])
    # multiples of 6: 6 (full 4 + 5-6), 12 (full 12 itself)
    assert kept(KeepEvery(6, last=1).retain(M)) == ([4, 12], [(5, 6), (13, 14)])
    # multiples of 4 are the fulls themselves
    assert kept(KeepEvery(4, last=1).retain(M)) == ([4, 8, 12], [(13, 14)])


def test_keep_every_each_kept_multiple_stays_reachable():
    for k in range(1, 16):
        out = KeepEvery(k, last=1).retain(M)
        for s in range(k, 15, k):
            assert out.retains(s), (k, s, kept(out))


def test_keep_every_follows_a_chain_across_batches_that_span_the_multiple():
    m = run([0, 10], [(1, 3), (4, 7), (8, 10), (11, 13)])
    assert kept(KeepEvery(5, last=1).retain(m)) == ([0, 10], [(1, 3), (4, 7), (11, 13)])


def test_keep_all_keeps_everything():
    assert KeepAll().retain(M) == M


def test_pinned_files_are_kept_whatever_the_policy():
    pinned = {full_name(0, "aaaaaaaa"), diff_name(1, 2, "aaaaaaaa")}
    assert kept(KeepLast(1).retain(M, pinned)) == ([0, 12], [(1, 2), (13, 14)])


def test_no_full_checkpoint_yet_keeps_everything():
    m = run([], [(1, 2), (3, 4)])
    assert kept(KeepLast(1).retain(m)) == kept(m)
    assert kept(KeepEvery(2, last=1).retain(m)) == kept(m)


@pytest.mark.parametrize("bad", [lambda: KeepLast(0), lambda: KeepEvery(0), lambda: KeepEvery(3, last=0),
                                 lambda: KeepLast(True)])
def test_bad_policies_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


def test_keep_every_keeps_a_full_whose_batches_have_not_arrived_yet():
    """Full 16 committed (or copied to a tier) before the batch 13-15 that makes step 15 reachable
    from full 12: full 12 must stay, and the batch is kept when it comes."""
    early = run([0, 4, 8, 12, 16], [(1, 3), (4, 4), (5, 7), (8, 8), (9, 11), (12, 12)])
    assert kept(KeepEvery(5, last=1).retain(early)) == ([4, 8, 12, 16], [(5, 7), (9, 11)])
    later = run([4, 8, 12, 16], [(5, 7), (9, 11), (13, 15)])
    assert kept(KeepEvery(5, last=1).retain(later)) == ([4, 8, 12, 16], [(5, 7), (9, 11), (13, 15)])


def test_keep_last_drops_an_earlier_sessions_full_at_the_step_a_resumed_session_started_from():
    # Session b resumed at step 8 (its base) and reached 12: a's full of step 8 is not newer than b's.
    m = Manifest([full(4), full(8), full(8, "bbbbbbbb"), full(12, "bbbbbbbb")],
                 [batch(5, 6), batch(7, 8), batch(9, 10, "bbbbbbbb"), batch(11, 12, "bbbbbbbb")], run="0" * 16)
    assert sorted((f.step, f.session) for f in KeepLast(2).retain(m).fulls) == [(8, "bbbbbbbb"), (12, "bbbbbbbb")]


def test_partitioned_tier_counts_complete_sets_and_keeps_newer_incomplete_shares():
    from lowdiff.store.retention import retain_sets

    def sets(*steps):
        return {(s, "aaaaaaaa") for s in steps}
    # Set 12 is not complete yet (another rank's share is not committed): the policy chooses among
    # 0, 4, 8; share 12 stays, being newer than the oldest full kept.
    assert kept(retain_sets(KeepLast(2), M, frozenset(), sets(0, 4, 8))) == \
        ([4, 8, 12], [(5, 6), (7, 8), (9, 10), (11, 12), (13, 14)])
    # Set 4 never completed and newer complete ones exist: its share goes.
    assert kept(retain_sets(KeepLast(2), M, frozenset(), sets(0, 8, 12))) == \
        ([8, 12], [(9, 10), (11, 12), (13, 14)])
    # Unless pinned (not yet drained to the shared tier).
    assert kept(retain_sets(KeepLast(1), M, {full(4).file}, sets(0, 8, 12)))[0] == [4, 12]
    # Nothing complete yet: nothing may go.
    assert kept(retain_sets(KeepLast(1), M, frozenset(), set())) == kept(M)
    assert kept(retain_sets(KeepEvery(5, last=1), M, frozenset(), sets(0, 4, 8, 12))) == \
        kept(KeepEvery(5, last=1).retain(M))
