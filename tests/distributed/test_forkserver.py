"""forkserver.py, the tests' way of starting worker processes: a forked worker behaves as a fresh
``python script.py`` / ``python -m module`` would (argv, __name__, environment, working directory,
sys.path, stdout and stderr, exit codes, SIGKILL), and a gloo run's digests are byte for byte those
of fresh interpreters."""
import os
import signal
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import forkserver  # noqa: E402
import partition_runs  # noqa: E402

SCRIPT = """
import atexit, os, sys
print("argv", sys.argv[1:], __name__, os.environ.get("FORKED_CASE"), os.getcwd(), sys.path[0], flush=True)
atexit.register(lambda: print("atexit ran", file=sys.stderr))
if sys.argv[1] == "raise":
    raise ValueError("from the worker")
if sys.argv[1] == "kill":
    os.kill(os.getpid(), 9)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("how", ["0", "3", "raise", "kill"])
def test_a_forked_worker_runs_as_a_fresh_interpreter(tmp_path, how):
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "FORKED_CASE": how}
    proc = forkserver.start([sys.executable, str(script), how], env, stdout=str(tmp_path / "out"),
                            cwd=str(tmp_path))
    want = {"0": 0, "3": 3, "raise": 1, "kill": -signal.SIGKILL}[how]
    assert proc.wait(timeout=60) == want and proc.returncode == want
    _, err = proc.communicate()
    assert (tmp_path / "out").read_text() == f"argv {[how]} __main__ {how} {tmp_path} {tmp_path}\n"
    assert ("atexit ran" in err) == (how != "kill")
    assert ("ValueError: from the worker" in err) == (how == "raise")


def test_a_module_runs_as_python_dash_m(tmp_path):
    proc = forkserver.start([sys.executable, "-m", "this"], None, stdout=str(tmp_path / "out"),
                            stderr=str(tmp_path / "err"))
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "out").read_text().startswith("The Zen of Python")
    assert proc.communicate() == (None, None)     # its stderr went to the file it was given


@pytest.mark.soak
def test_a_forked_gloo_run_has_a_fresh_interpreters_digests(tmp_path, monkeypatch):
    for mode in ("0", "1"):
        monkeypatch.setenv("LOWDIFF_TEST_FORKSERVER", mode)
        partition_runs.ok(partition_runs.launch(tmp_path / mode, tmp_path / f"d{mode}", 2, steps=6))
    for rank in range(2):
        assert (tmp_path / f"d0-{rank}.txt").read_bytes() == (tmp_path / f"d1-{rank}.txt").read_bytes()
