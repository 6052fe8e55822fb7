"""HSDP together with FSDP2 mixed precision (issue #31): a (2, 2) mesh of 4 gloo processes with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` (torchtitan's
default). FSDP2 reduce-scatters in float32 within a row, all-reduces across the replicate dimension
and casts back before the chunk becomes the float32 sharded parameter's gradient, which is what lowdiff
records; each chunk is written by one rank of its replicate group ("2-D meshes"). After a SIGKILL
of every rank the job resumes each rank's state byte for byte as the uninterrupted run had it and
trains on identically. (Each piece was tested alone before: HSDP in float32, mixed precision on a
1-D mesh.)"""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_fsdp2_hsdp import launch  # noqa: E402
from test_fsdp2_resume import digests, ok  # noqa: E402

STEPS = 8
HSDP_BF16 = ("--hsdp", "--mp", "bf16", "--compressor", "topk", "--optimizer", "adamw")

# Three 4-rank launches (~40 s on this machine): -m soak, beside the float32 HSDP test and the 1-D mixed-
# precision test the default suite runs.
pytestmark = [pytest.mark.four_ranks, pytest.mark.soak]


def test_hsdp_with_bfloat16_compute_resumes_exactly_after_sigkill(tmp_path):
    ok(launch(tmp_path / "ref", tmp_path / "ref", 4, *HSDP_BF16))
    reference = [digests(tmp_path / f"ref-{rank}.txt")[1] for rank in range(4)]
    crashed = launch(tmp_path / "run", tmp_path / "run", 4, *HSDP_BF16, "--crash-at", "7")
    assert [code for code, _ in crashed] == [-9] * 4, crashed
    ok(launch(tmp_path / "run", tmp_path / "res", 4, *HSDP_BF16))
    resumed = set()
    for rank in range(4):
        step, got = digests(tmp_path / f"res-{rank}.txt")
        resumed.add(step)
        # full_every 4, batch_steps 2, killed after step 7 unflushed: step 4's set at least is durable.
        assert step >= 4 and sorted(got) == list(range(step, STEPS + 1)), (rank, step)
        for s, value in got.items():
            assert value == reference[rank][s], (rank, s)
    assert len(resumed) == 1
