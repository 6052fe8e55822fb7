"""The rule a dropped rank's directory follows (lowdiff.distributed.shareretention.follow) and the set arithmetic
of a partitioned directory (lowdiff.distributed.partition): complete sets, reach, durable step, retained steps."""
from lowdiff.distributed.partition import ShareSet, durable_step, full_sets, retained_ranges
from lowdiff.distributed.shareretention import follow
from lowdiff.store.manifest import BatchEntry, FullEntry, Manifest


def full(step, session):
    return FullEntry(step, f"full-{step:012d}-{session}.ldf", 100, session)


def batch(first, last, session):
    return BatchEntry(first, last, f"diff-{first:012d}-{last:012d}-{session}.ldd", 10, session)


def test_a_dropped_rank_keeps_what_the_live_rank_keeps():
    old = "aaaaaaaa"
    dropped = Manifest(fulls=[full(6, old), full(12, old)],
                       batches=[batch(7, 9, old), batch(10, 12, old), batch(13, 15, old), batch(16, 16, old)])
    live = Manifest(fulls=[full(6, old), full(12, old)])
    assert follow(dropped, live) == dropped                       # nothing retired yet: all stays
    live = Manifest(fulls=[full(12, old), full(16, "bbbbbbbb")])  # the live rank retired set 6
    kept = follow(dropped, live)
    assert kept.fulls == [full(12, old)]
    assert kept.batches == [batch(13, 15, old), batch(16, 16, old)]   # set 12's chain
    live = Manifest(fulls=[full(16, "bbbbbbbb"), full(22, "bbbbbbbb")])
    assert follow(dropped, live).files() == set()                  # no old set left: nothing needed


def test_sets_reach_and_retained_steps():
    a, b = "aaaaaaaa", "bbbbbbbb"
    manifests = {0: Manifest(fulls=[full(6, a), full(12, a), full(18, b)],
                             batches=[batch(7, 9, a), batch(10, 12, a), batch(13, 15, a), batch(19, 20, b)]),
                 1: Manifest(fulls=[full(6, a), full(12, a)],
                             batches=[batch(7, 9, a), batch(10, 12, a), batch(13, 14, a)]),
                 2: None}
    counts = {(6, a): 2, (12, a): 2, (18, b): 2}
    sets = full_sets("/nonexistent", manifests, lambda step, session: counts[(step, session)])
    assert sets == [ShareSet(6, a, 2, frozenset({0, 1})), ShareSet(12, a, 2, frozenset({0, 1})),
                    ShareSet(18, b, 2, frozenset({0}))]
    assert [s.complete for s in sets] == [True, True, False]
    assert sets[1].reach(manifests) == 14                          # the smaller of 15 and 14
    assert durable_step(manifests, sets) == 14                      # set 18 is incomplete
    assert retained_ranges(manifests, sets) == [(6, 14)]
