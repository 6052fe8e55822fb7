"""Retention policies (lowdiff.retention): what each keeps, exactly, on hand-built manifests."""
from __future__ import annotations

import pytest

from lowdiff.manifest import BatchEntry, FullEntry, Manifest, diff_name, full_name
from lowdiff.retention import KeepAll, KeepEvery, KeepLast


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
