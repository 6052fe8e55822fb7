"""SIGTERM during a lowdiff call that does not return: the process still ends (after
LOWDIFF_TERM_GRACE_S, or at once on a second SIGTERM) instead of becoming immune to SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

STUCK = """
import sys, threading, time, torch, lowdiff
model = torch.nn.Linear(2, 2)
opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, sys.argv[1])
model(torch.randn(1, 2)).sum().backward()
opt.step()
opt._session.flush = lambda: time.sleep(3600)     # a flush that never returns
print("stuck", flush=True)
opt.flush()
"""


@pytest.mark.parametrize("second_signal", [False, True])
def test_sigterm_ends_a_process_stuck_inside_lowdiff(tmp_path, second_signal):
    env = {**os.environ, "LOWDIFF_TERM_GRACE_S": "2" if not second_signal else "3600"}
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(tmp_path / "ckpt")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "stuck"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        if second_signal:
            time.sleep(0.5)
            assert proc.poll() is None, "the first SIGTERM waits for the call in progress"
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        assert "terminating without flushing" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
