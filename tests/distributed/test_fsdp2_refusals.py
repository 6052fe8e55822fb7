"""Sharded training lowdiff cannot record is refused at wrap(), before anything is written, with a
message naming the module or parameter and what to do (issue #31, item 4). Before, a sharded model
trained until the first checkpoint and then failed in the background ('.numpy() is not supported for
tensor subclasses', 'copy_regions: region 0 has a null address'); FSDP1, ZeRO and Partial placements
were not looked at."""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from partition_runs import free_port  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "fsdp_refusal_worker.py")


def run(tmp_path, world, cases):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "--rank", str(rank), "--world", str(world), "--port", str(port),
                               "--dir", str(tmp_path / f"rank{rank}"), "--cases", ",".join(cases)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(world)]
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        reports.append({r["case"]: r for r in map(json.loads, out.splitlines())})
    return reports


# case -> (exception type, words the message must hold)
REFUSED = {
    "tensor_parallel": ("TypeError", ["'0.weight'", "DTensor", "outside any fully_shard()ed module"]),
    "fsdp2_replica": ("ValueError", ["'0.weight'", "replica mode", "full_every/batch_steps"]),
    "fsdp2_tp": ("TypeError", ["'0.weight'", "2-D mesh of shape (1, 1)", "Shard(dim=0)", "tensor parallelism",
                               "HSDP", "1-D mesh"]),
    "fsdp2_offload": ("ValueError", ["the model", "CPUOffloadPolicy", "OffloadPolicy()"]),
    "fsdp1": ("TypeError", ["module '2'", "FSDP1 FullyShardedDataParallel", "fully_shard"]),
    "zero": ("TypeError", ["ZeroRedundancyOptimizer", "(SGD)", "DistributedDataParallel"]),
    "partial": ("ValueError", ["'2.weight'", "Partial(sum)", "Shard or Replicate"]),
}


def test_refused_at_wrap_with_the_culprit_named(tmp_path):
    (reports,) = run(tmp_path, 1, ["plain", "fsdp2", "hsdp", "fsdp2_default_policies", "fsdp2_own_dtype_policy",
                                   "fsdp2_mixed", "fsdp2_reduce_bf16",
                                   *REFUSED])
    assert reports["plain"]["error"] is None   # an unsharded model under torch.distributed still wraps
    assert reports["fsdp2"]["error"] is None   # FSDP2 on a 1-D mesh is recorded (test_fsdp2_resume.py)
    assert reports["hsdp"]["error"] is None    # HSDP on a 2-D mesh too (test_fsdp2_hsdp.py)
    # the policies the refusals tell the user to pass, spelled out, are accepted
    assert reports["fsdp2_default_policies"]["error"] is None, reports["fsdp2_default_policies"]
    # a policy naming the parameters' own dtype (torchtitan's on float32 models) casts nothing: accepted
    assert reports["fsdp2_own_dtype_policy"]["error"] is None, reports["fsdp2_own_dtype_policy"]
    # mixed precision: the optimizer still consumes the float32 .grad lowdiff records
    # (test_fsdp2_mixed_precision.py resumes such runs exactly)
    for case in ("fsdp2_mixed", "fsdp2_reduce_bf16"):
        assert reports[case]["error"] is None, reports[case]
    for case, (error, words) in REFUSED.items():
        report = reports[case]
        assert report["error"] == error, report
        for word in words:
            assert word in report["message"], (case, word, report["message"])
        assert report["files"] == [], report   # refused before the directory was touched

