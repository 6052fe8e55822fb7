"""Replica mode (LowDiff+) under DDP on real gloo processes (partition_worker.py --replica): every
rank keeps a whole replica, applies the all-reduced gradient to it and writes its share of each
replica checkpoint at the same steps as the other rank (complete sets), with differential shares
for the steps since. A rank SIGKILLed mid-run (the other taken down, as torchrun does) resumes
with both ranks on the state of an uninterrupted run, byte for byte, at or after the newest step
both had flushed. (That replica mode does not change the training it checkpoints is checked by
the single-process tests against training without lowdiff.)"""
import os
import sys

from lowdiff.distributed.partition import rank_directory
from lowdiff.store.manifest import read_manifest

sys.path.insert(0, os.path.dirname(__file__))
from test_partitioned import STEPS, digests, launch, ok  # noqa: E402

REPLICA = ("--compressor", "dense", "--replica", "--full-every", "3", "--batch-steps", "2")


def test_rank_killed_then_resumed_exactly(tmp_path):
    ok(launch(tmp_path / "reference", tmp_path / "ref", 2, *REPLICA))
    ref = [digests(tmp_path / f"ref-{rank}.txt")[1] for rank in range(2)]
    assert ref[0][STEPS][0] != ref[1][STEPS][0]   # per-rank state differs: equal digests are a real check
    # Every rank persisted its share of the same replica steps: 3, 6, ... and the last at close.
    # (A rank may still list an older share: retention waits until the newer set is complete.)
    steps = [{f.step for f in read_manifest(rank_directory(tmp_path / "reference", rank)).fulls} for rank in range(2)]
    assert all(STEPS in s and all(k % 3 == 0 or k == STEPS for k in s) for s in steps), steps

    crashed = launch(tmp_path / "ckpt", tmp_path / "run", 2, *REPLICA, "--flush", "--crash-at", "10",
                     "--crash-ranks", "1")
    assert crashed[1][0] == -9
    ok(launch(tmp_path / "ckpt", tmp_path / "resumed", 2, *REPLICA))
    start = digests(tmp_path / "resumed-0.txt")[0]
    # Flushed: both ranks had made step 9 durable before either could finish step 10 (DDP's
    # all-reduce keeps them in step); rank 1 flushed 10 before it died.
    assert 9 <= start <= 10, start
    for rank in range(2):
        got_start, got = digests(tmp_path / f"resumed-{rank}.txt")
        assert got_start == start, "ranks resumed at different steps"
        assert got[start] == ref[rank][start], f"rank {rank}: state at step {start} differs"
        assert sorted(got) == list(range(start, STEPS + 1))
        assert all(got[s] == ref[rank][s] for s in got), f"rank {rank}: the resumed run diverged"
    full_step = int(next(line.split()[1] for line in (tmp_path / "resumed-0.txt").read_text().splitlines()
                         if line.startswith("from-full ")))
    assert full_step % 3 == 0 and full_step <= start
