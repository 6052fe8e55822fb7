"""Running partition_worker.py ranks as real processes (gloo) and reading what they report; shared
by the partitioned-directory tests (the uninterrupted reference run is conftest.py's fixture)."""
import os
import signal
import socket
import subprocess
import sys
import time

import forkserver

WORKER = os.path.join(os.path.dirname(__file__), "partition_worker.py")
STEPS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(directory, digests, world, *extra, fault_rank=None, fault=None, timeout=180, steps=STEPS,
           worker=WORKER, envs=None):
    """Run ``world`` ranks; when one dies of SIGKILL the others are killed too (as torchrun does).
    ``envs``: each rank's extra environment variables. Returns [(exit code, stderr)] by rank."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        if fault is not None and rank == fault_rank:
            env["LOWDIFF_FAULT"] = fault
        env.update(envs[rank] if envs else {})
        args = [sys.executable, worker, "--rank", str(rank), "--world", str(world), "--port", str(port),
                "--steps", str(steps), "--dir", str(directory), "--digests", f"{digests}-{rank}.txt", *extra]
        procs.append(forkserver.start(args, env))   # a fresh process, torch already imported
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        overdue = time.monotonic() > deadline
        if any(p.returncode == -9 for p in procs) or overdue:
            if overdue:
                show_stacks(procs)
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.05)
    return [(p.returncode, p.communicate()[1]) for p in procs]


def show_stacks(procs) -> None:
    """Ask every worker still running to print its threads' stacks to its stderr (forkserver
    registers SIGUSR1 for that), so a hang's failure message says where each rank was."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGUSR1)
    time.sleep(1.0)


def digests(path):
    """(resumed step, {step: (full digest, shared digest)})."""
    resumed, out = None, {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "resumed":
                resumed = int(parts[1])
                out[resumed] = (parts[2], parts[3])
            elif parts[0] == "from-full":
                continue
            else:
                out[int(parts[0])] = (parts[1], parts[2])
    return resumed, out


def resumed_exactly(out_prefix, ref, ranks: int = 2, latest: int = 10) -> int:
    """The step every rank of a resumed run (outputs ``<out_prefix>-<rank>.txt``) resumed at, after
    checking that they agree, that it is in 1..``latest``, and that each rank's state at that step
    and at the end equals the uninterrupted run's (``ref[rank]``)."""
    start = digests(f"{out_prefix}-0.txt")[0]
    assert 0 < start <= latest, start
    for rank in range(ranks):
        got_start, got = digests(f"{out_prefix}-{rank}.txt")
        assert got_start == start, "ranks resumed at different steps"
        assert got[start] == ref[rank][start], f"rank {rank}: state at step {start} differs"
        assert got[STEPS] == ref[rank][STEPS], f"rank {rank}: final state differs"
    return start


def ok(results):
    """The ranks' stderr joined, after checking that every rank exited cleanly."""
    for code, err in results:
        assert code == 0, err
    return "".join(err for _, err in results)


def copy_directory(directory, target):
    subprocess.run(["cp", "-a", str(directory), str(target)], check=True)
    return target


def checkpoint_files(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(("full-", "diff-")))
