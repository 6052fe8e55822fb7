"""Striping full checkpoints over several drives (Options(stripe_dirs=...)) is single-process only
for now: under torch.distributed, wrap() refuses it on every rank, before any collective and before
anything is written (docs/guide.md, "Several local drives")."""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
from partition_runs import free_port  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "stripe_refusal_worker.py")


def test_two_gloo_ranks_are_refused_alike_and_nothing_is_written(tmp_path):
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "--rank", str(rank), "--world", "2", "--port", str(port),
                               "--dir", str(tmp_path / f"rank{rank}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        report = json.loads(out.splitlines()[-1])
        assert report["error"] == "ValueError" and "not supported under torch.distributed" in report["message"]
        assert "stripe_dirs" in report["message"] and not report["written"]
