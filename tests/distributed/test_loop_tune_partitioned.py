"""Issue #27, friction: ``python -m lowdiff tune DIR`` on a partitioned directory (a real 2-rank
gloo run with fixed settings) reads the costs rank 0 measured and kept in its rank directory's
CONTROLLER.json. Fails on the old code (no DIR argument)."""
from __future__ import annotations

import os

from partition_runs import launch, ok

from lowdiff.cli.main import main


def test_tune_reads_rank_0s_costs_of_a_partitioned_directory(tmp_path, capsys):
    directory = tmp_path / "ckpt"
    ok(launch(directory, tmp_path / "digests", 2, steps=8))
    assert os.path.exists(directory / "rank-00000" / "CONTROLLER.json")
    assert main(["tune", str(directory), "--failure-rate-per-hour", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "is partitioned: the costs rank 0 measured" in out and "this run's settings" in out
