"""FSDP2 mixed precision (issue #31): under ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, ...)``
FSDP2 computes in bfloat16 but keeps float32 sharded parameters and hands the optimizer a float32
gradient chunk (cast back after the reduce-scatter), which lowdiff records at ``step()``: the replay
on the float32 chunk is exact. 2 gloo ranks, every rank SIGKILLed after step 7: the restarted job
resumes every rank's state byte for byte as the uninterrupted run had it and trains on identically,
and a resume at 1 rank (resharded) gathers to the uninterrupted run's state. Before, wrap() refused
any policy that casts ("lowdiff does not record under FSDP2 mixed-precision policies")."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from test_fsdp2_resume import assert_resumed_exactly, check_resharded, copied, crashed_run, launch, ok, resume_at  # noqa: E402,I001

# policy (fsdp2_worker.POLICIES), compressor, optimizer. One case by default (the suite's time):
# the others run with -m soak; torchtitan's bfloat16 default is SIGKILLed and resumed by default in
# tests/distributed/test_torchtitan.py as well.
CASES = [pytest.param("bf16", "dense", "adamw",       # torchtitan's default: bfloat16 compute, float32 reduction
                      marks=pytest.mark.soak),
         ("bf16-reduce", "topk", "adamw"),            # reduced in bfloat16 too; the root's output cast to float32
         pytest.param("fp16", "topk", "sgd",          # float16 compute, float32 reduction; SGD with momentum
                      marks=pytest.mark.soak)]


@pytest.mark.parametrize("policy,compressor,optimizer", CASES)
def test_mixed_precision_resumes_exactly_and_reshards(tmp_path, policy, compressor, optimizer):
    extra = ("--mp", policy, "--compressor", compressor, "--optimizer", optimizer)
    reference, directory = crashed_run(tmp_path, *extra)
    ok(launch(copied(directory, tmp_path / "again"), tmp_path / "res", 2, *extra))
    assert_resumed_exactly(tmp_path, reference, "res", lowest=4)
    check_resharded(reference[2], resume_at(tmp_path, directory, 1, *extra))
