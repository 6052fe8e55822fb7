"""An FSDP2 directory seen as a directory (issue #31, item 6): retention keeps complete sets in every
rank directory and what it keeps resumes exactly; ``inspect`` says which tensors are DTensor chunks
(global shape, placements, each share's global ranges) and says in words that a share holds none of
the shared payload (it printed "bytes 0..0 of 4096" and nothing about chunks)."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_fsdp2_resume import STEPS, copied, digests, launch, ok  # noqa: E402


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """A 10-step 2-rank FSDP2 run (Dense, AdamW, full_every 4, batch_steps 2) with KeepLast(2):
    every rank's digests by step, and the directory."""
    base = tmp_path_factory.mktemp("kept")
    ok(launch(base / "run", base / "ref", 2, "--keep-last", "2"))
    return [digests(base / f"ref-{rank}.txt")[1] for rank in range(2)], base / "run"


def names(directory, rank, prefix):
    return sorted(n for n in os.listdir(directory / f"rank-{rank:05d}") if n.startswith(prefix))


def test_keep_last_keeps_complete_sets_in_every_rank_directory_and_they_resume_exactly(tmp_path, kept):
    reference, directory = kept
    fulls = [names(directory, rank, "full-") for rank in range(2)]
    # sets at steps 0, 4, 8: the oldest is gone from both rank directories, the two newest are whole
    assert fulls[0] == fulls[1] and [int(n.split("-")[1]) for n in fulls[0]] == [4, 8], fulls
    diffs = [names(directory, rank, "diff-") for rank in range(2)]
    assert diffs[0] == diffs[1] and min(int(n.split("-")[1]) for n in diffs[0]) == 5, diffs   # 1..4 only fed set 0
    # the newest step, and the oldest retained one past a set (from step 4's set, its chain replayed)
    for step, extra in ((STEPS, ()), (5, ("--resume-step", "5"))):
        name = f"at{step}"
        ok(launch(copied(directory, tmp_path / name), tmp_path / name, 2, "--resume-only", "--keep-last", "2", *extra))
        for rank in range(2):
            resumed, got = digests(tmp_path / f"{name}-{rank}.txt")
            assert resumed == step and got[step] == reference[rank][step], (step, rank)


def test_inspect_names_the_chunks_of_a_sharded_directory(kept):
    _, directory = kept
    result = subprocess.run([sys.executable, "-m", "lowdiff", "inspect", str(directory)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "durable step   10" in out and "complete full-checkpoint sets at steps 4, 8" in out, out
    # the set's few replicated tensors (AdamW's step counts) fall in share 1's range: share 0 holds none
    assert "share 0 of 2: 15 own tensors (12 of them DTensor chunks), none of the 4096-byte shared payload" in out
    assert "share 1 of 2: 15 own tensors (12 of them DTensor chunks), shared payload bytes 0..4096 of 4096" in out
    assert "bytes 0..0" not in out
    chunks = out[out.index("sharded tensors of the set of step 8"):].splitlines()[1:]
    assert len(chunks) == 12, out   # 4 parameters, each with exp_avg and exp_avg_sq
    # the last Linear has 5 rows: uneven chunks, 3 rows and 2
    assert "  /model/3.weight  global [5, 24]  S0 on mesh [2]  chunks 0: [0:3, 0:24], 1: [3:5, 0:24]" in chunks
    assert "  /optimizer/state/0/exp_avg  global [24, 8]  S0 on mesh [2]  chunks 0: [0:12, 0:8], 1: [12:24, 0:8]" \
        in chunks
