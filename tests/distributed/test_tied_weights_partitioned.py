"""Tied weights in a partitioned directory (real gloo ranks, partition_worker.py --tied): the shared
layout holds the tied memory once; a rank SIGKILLed mid-run, all ranks restarted, resume lands on the
uninterrupted run's state byte for byte and trains on to the same end; the directory resumed with 1
and 3 ranks gives the same model and optimizer state."""
import os
import sys

import fastio
from lowdiff.cli.main import main as cli
from lowdiff.format.sharefile import read_full_share_index

sys.path.insert(0, os.path.dirname(__file__))
from partition_runs import STEPS, digests, launch, ok  # noqa: E402


def shared_layout_keys(directory) -> list:
    """The shared tensors' keys of every full-checkpoint share file in the directory."""
    found = []
    for rank_dir in sorted(d for d in os.listdir(directory) if d.startswith("rank-")):
        for name in sorted(os.listdir(os.path.join(directory, rank_dir))):
            if name.startswith("full-"):
                path = os.path.join(directory, rank_dir, name)
                with fastio.Reader(path) as reader:
                    found.append([entry["key"] for entry in read_full_share_index(path, reader).layout])
    return found


def test_tied_weights_partitioned_resume_exactly_at_any_world_size(tmp_path, capsys):
    ok(launch(tmp_path / "ref", tmp_path / "ref", 2, "--tied"))
    crashed = launch(tmp_path / "ckpt", tmp_path / "run", 2, "--tied", "--crash-at", "10", "--crash-ranks", "1")
    assert crashed[1][0] == -9

    layouts = shared_layout_keys(tmp_path / "ckpt")
    assert layouts
    for keys in layouts:
        assert "/model/body.4.weight" in keys and "/model/mirror.weight" not in keys, keys
    assert cli(["verify", str(tmp_path / "ckpt")]) == 0, capsys.readouterr().out

    ok(launch(tmp_path / "ckpt", tmp_path / "resumed", 2, "--tied"))
    start = digests(tmp_path / "resumed-0.txt")[0]
    assert 0 < start <= 10
    for rank in range(2):
        _, ref = digests(tmp_path / f"ref-{rank}.txt")
        got_start, got = digests(tmp_path / f"resumed-{rank}.txt")
        assert got_start == start
        assert got[start] == ref[start], f"rank {rank}: state at step {start} differs"
        assert got[STEPS] == ref[STEPS], f"rank {rank}: final state differs"

    _, ref0 = digests(tmp_path / "ref-0.txt")
    ok(launch(tmp_path / "ckpt", tmp_path / "w1", 1, "--tied", "--resume-only"))
    ok(launch(tmp_path / "ckpt", tmp_path / "w3", 3, "--tied", "--resume-only"))
    assert digests(tmp_path / "w1-0.txt")[1][STEPS] == ref0[STEPS]
    for rank in range(3):
        step, got = digests(tmp_path / f"w3-{rank}.txt")
        assert step == STEPS and got[STEPS][1] == ref0[STEPS][1]
