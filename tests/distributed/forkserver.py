"""Starting the tests' worker processes without paying for ``import torch`` in every one.

``start(args, env)`` runs ``args`` (``[sys.executable, "worker.py", ...]`` or ``[sys.executable,
"-m", "module", ...]``) and returns an object with the parts of ``subprocess.Popen`` the launch
helpers use (``pid``, ``returncode``, ``poll``, ``wait``, ``kill``, ``communicate`` with stderr as
text). It forks the worker from a server process that has imported numpy, torch's distributed
modules and boto3 once: on the 2-core test machine a 2-rank partition_worker launch of 16 steps took
3.1 s instead of 8.3 s (load 5; the imports were most of a launch). The worker is still a process of
its own, run as ``__main__`` with its own argv, environment, working directory, sys.path and
standard streams, ends the way a fresh interpreter ends (atexit handlers, non-daemon threads, the
exit code of an uncaught exception), and dies of a real SIGKILL; its digests are byte for byte
those of a fresh interpreter's run. The server imports nothing of lowdiff, fastio or recovery:
lowdiff reads LOWDIFF_FAULT when it is imported, in the worker. Tests that read a worker's stdout
as it runs (test_kill_resume.py) and the traced crash-state runs keep fresh interpreters;
``LOWDIFF_TEST_FORKSERVER=0`` gives every launch a fresh interpreter.
"""
from __future__ import annotations

import atexit
import faulthandler
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

# Read no environment variable of the tests' when imported (lowdiff does: LOWDIFF_FAULT); boto3 only
# where installed (the s3 extra).
_PREIMPORTED = ("numpy", "torch", "torch.distributed", "torch.nn.parallel", "torch.distributed.fsdp",
                "torch.distributed.tensor", "boto3")


class Forked:
    """A worker forked by the server (what ``subprocess.Popen`` offers to the launch helpers)."""

    def __init__(self, server: _Server, pid: int, args: list, stderr_path: str | None):
        self._server, self.pid, self.args, self._stderr_path = server, pid, args, stderr_path
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.status(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        # The server signals it only while it has not reaped it: the pid cannot belong to another
        # process yet (pids are reused: pid_max is 32768 here).
        if self.returncode is None:
            self._server.signal(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[None, str | None]:
        """(None, stderr): stderr as text where start() was given no file for it."""
        self.wait(timeout)
        if self._stderr_path is None:
            return None, None
        with open(self._stderr_path, errors="replace") as f:
            err = f.read()
        os.unlink(self._stderr_path)
        self._stderr_path = None
        return None, err


class _Server:
    def __init__(self):
        self._process = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)
        self._lock = threading.Lock()
        self._scratch = tempfile.mkdtemp(prefix="lowdiff-forkserver-")
        self._count = 0

    def _ask(self, request: dict):
        assert self._process.stdin is not None and self._process.stdout is not None
        with self._lock:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the fork server exited (code {self._process.poll()})")
        return json.loads(answer)

    def start(self, args: list, env: dict, stdout: str | None, stderr: str | None, cwd: str | None) -> Forked:
        self._count += 1
        captured = os.path.join(self._scratch, f"{self._count}.err") if stderr is None else None
        pid = self._ask({"op": "start", "argv": list(map(str, args[1:])), "env": env, "cwd": cwd or os.getcwd(),
                         "stdout": stdout or os.devnull, "stderr": stderr or captured})
        return Forked(self, pid, args, captured)

    def status(self, pid: int) -> int | None:
        return self._ask({"op": "poll", "pid": pid})

    def signal(self, pid: int, sig: int) -> None:
        self._ask({"op": "signal", "pid": pid, "sig": sig})

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(30)
        self._process.stdout.close()
        for name in os.listdir(self._scratch):
            os.unlink(os.path.join(self._scratch, name))
        os.rmdir(self._scratch)


_server: _Server | None = None


def start(args: list, env: dict | None = None, *, stdout: str | None = None, stderr: str | None = None,
          cwd: str | None = None):
    """``subprocess.Popen(args, env=env, cwd=cwd, ...)`` for ``[sys.executable, "script.py", ...]`` or
    ``[sys.executable, "-m", "module", ...]``, its stdout into the file ``stdout`` (None: discarded)
    and its stderr into the file ``stderr`` (None: ``communicate()`` returns it as text)."""
    global _server
    env = dict(os.environ) if env is None else env
    runnable = len(args) >= 2 and args[0] == sys.executable and (str(args[1]).endswith(".py") or
                                                                  (args[1] == "-m" and len(args) >= 3))
    if os.environ.get("LOWDIFF_TEST_FORKSERVER") == "0" or not runnable:
        out = open(stdout, "w") if stdout else subprocess.DEVNULL
        err = open(stderr, "w") if stderr else subprocess.PIPE
        try:
            return subprocess.Popen(args, stdout=out, stderr=err, text=True, env=env, cwd=cwd)
        finally:
            for f in (out, err):
                if not isinstance(f, int):
                    f.close()
    if _server is None:
        _server = _Server()
        atexit.register(_server.close)
    return _server.start(args, env, stdout, stderr, cwd)


# ------------------------------------------------------------------------------------ the server
def _become(request: dict) -> None:
    """In the forked child: become ``python argv...`` (as a fresh interpreter would run it) and exit."""
    import runpy

    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    # The standard streams as a fresh interpreter opens them on these files (PYTHONUNBUFFERED: a
    # trainer killed by SIGKILL leaves the lines it wrote; stderr line by line in any case).
    write_through = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0 if write_through else -1, closefd=False),
                                  write_through=write_through)
    sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), line_buffering=True,
                                  errors="backslashreplace")
    # A worker that hangs can be asked where it is: SIGUSR1 prints every thread's Python stack to
    # its stderr (the launch helpers send it before they kill a worker past its deadline).
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    argv = request["argv"]
    # sys.path as `python script.py` (the script's folder) or `python -m module` (the working
    # directory) builds it, then PYTHONPATH, then the rest.
    ours = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if argv[0] == "-m":
        sys.path[:] = [os.getcwd(), *ours, *_BASE_PATH]
        sys.argv[:] = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.path[:] = [os.path.dirname(script), *ours, *_BASE_PATH]
        sys.argv[:] = [script, *argv[1:]]
        runpy.run_path(script, run_name="__main__")
    # An uncaught exception or SystemExit leaves from here to the interpreter's own exit (traceback,
    # threads joined, atexit handlers, exit code), as it would in a fresh interpreter.
    sys.exit(0)


def _serve() -> None:
    # The children not reaped yet. A pid is asked about until its exit code is answered once (the
    # client keeps it), then reaped: a later child may get the same pid.
    running: set = set()
    for line in sys.stdin:
        request = json.loads(line)
        answer = None
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                _become(request)
            running.add(pid)
            answer = pid
        elif request["pid"] not in running:
            raise RuntimeError(f"asked about {request}, not a running child")
        elif request["op"] == "signal":
            os.kill(request["pid"], request["sig"])     # not reaped: still ours, if only a zombie
        else:
            done, status = os.waitpid(request["pid"], os.WNOHANG)
            if done:
                running.discard(done)
                answer = os.waitstatus_to_exitcode(status)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _BASE_PATH = [p for p in sys.path[1:]
                  if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    import importlib

    for _name in _PREIMPORTED:
        try:
            importlib.import_module(_name)
        except ImportError:
            pass
    _serve()
