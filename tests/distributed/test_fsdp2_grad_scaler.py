"""FSDP2's fp16 recipe with ``ShardedGradScaler`` as ``wrap(grad_scaler=...)`` (issue #31): 2 gloo
ranks, ``MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)``, the loss
scaled; ``scaler.unscale_(opt)`` is called before odd steps (as a loop that clips gradients does),
not before even ones. At step 6 rank 0's gradient chunk holds an inf (as an fp16 overflow that lands
in one rank's chunk after the reduce-scatter): the step is skipped on every rank (checked: the
gathered state does not move) and the scale backs off. lowdiff records the step as skipped in both
ranks' differential shares, with the scaler's state, and after a SIGKILL of every rank after step 7
the job resumes each rank's state (the scaler's scale and growth tracker among it) byte for byte as
the uninterrupted run had it, and trains on identically. Runs on CPU with gloo in torch 2.13."""
import os
import sys

from lowdiff.format.records import decode_record
from lowdiff.format.sharefile import parse_diff_share

sys.path.insert(0, os.path.dirname(__file__))
from test_fsdp2_resume import assert_resumed_exactly, copied, crashed_run, launch, ok  # noqa: E402,I001

SCALED = ("--mp", "fp16", "--sharded-scaler", "--compressor", "dense", "--optimizer", "adamw")


def _records(directory, rank: int) -> dict:
    """{step: StepRecord} of every differential share of rank ``rank``."""
    out = {}
    rank_dir = directory / f"rank-{rank:05d}"
    for name in sorted(n for n in os.listdir(rank_dir) if n.startswith("diff-")):
        data = (rank_dir / name).read_bytes()
        index = parse_diff_share(str(rank_dir / name), data)
        for step, offset, nbytes in index.batch.records:
            out[step] = decode_record(memoryview(data)[offset:offset + nbytes], name, offset, expected_step=step)
    return out


def test_sharded_grad_scaler_skipped_step_is_recorded_and_resumed_exactly(tmp_path):
    reference, directory = crashed_run(tmp_path, *SCALED)
    # The uninterrupted run skipped step 6 on both ranks (gathered, parameters and optimizer state
    # did not move), and each rank's share records it as skipped, with the inf found.
    assert reference[2][6] == reference[2][5] and reference[2][5] != reference[2][4]
    for rank in range(2):
        records = _records(tmp_path / "ref", rank)
        assert [s for s, r in records.items() if r.skipped] == [6], rank
        scaler = {s: r.objects["grad_scaler"] for s, r in records.items()}
        # (each record holds the scaler's state before that step's update(), and whether it found
        # an inf: resume redoes the update)
        assert [s for s, state in scaler.items() if state["found_inf"]] == [6], rank
    ok(launch(copied(directory, tmp_path / "again"), tmp_path / "res", 2, *SCALED))
    assert_resumed_exactly(tmp_path, reference, "res", lowest=4)
