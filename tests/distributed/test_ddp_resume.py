"""DDP with lowdiff's compressed comm hook on real gloo processes: a run SIGKILLed on every rank
resumes, in new processes, at one step all ranks agree on, bit for bit equal to an uninterrupted run."""
import os
import socket
import subprocess
import sys

sys.path.insert(0, os.path.dirname(__file__))
import forkserver  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "ddp_worker.py")
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(directory, steps, digest_dir, tag, crash_at=None, timeout=240):
    port = free_port()
    procs = []
    for rank in range(WORLD):
        args = [sys.executable, WORKER, str(rank), str(WORLD), str(port), str(directory), str(steps),
                str(digest_dir / f"{tag}-{rank}.txt")]
        if crash_at is not None:
            args.append(str(crash_at))
        procs.append(forkserver.start(args))   # its own process, torch already imported
    results = []
    for proc in procs:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append((proc.returncode, err))
    return results


def read_digests(path):
    resumed, digests = None, {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "resumed":
                resumed = int(parts[1])
                digests[resumed] = parts[2]
            else:
                digests[int(parts[0])] = parts[1]
    return resumed, digests


def test_ddp_sigkill_resume_is_exact_on_every_rank(tmp_path):
    steps, crash_at = 16, 10
    for code, err in run_ranks(tmp_path / "ref", steps, tmp_path, "ref"):
        assert code == 0, err
    crashed = run_ranks(tmp_path / "ckpt", steps, tmp_path, "run", crash_at=crash_at)
    assert all(code == -9 for code, _ in crashed), [err for _, err in crashed]
    for code, err in run_ranks(tmp_path / "ckpt", steps, tmp_path, "resumed"):
        assert code == 0, err
    starts = set()
    for rank in range(WORLD):
        _, reference = read_digests(tmp_path / f"ref-{rank}.txt")
        start, resumed = read_digests(tmp_path / f"resumed-{rank}.txt")
        starts.add(start)
        assert 0 < start <= crash_at
        assert crash_at - start <= 2 * 3 + 1, "lost more than about two batches"
        assert resumed[start] == reference[start], f"rank {rank}: state at step {start} differs"
        assert resumed[steps] == reference[steps], f"rank {rank}: final state differs"
        # ranks differ in RNG and sampler, so equal digests per rank are a real check
    assert len(starts) == 1, f"ranks resumed at different steps: {starts}"
    _, ref0 = read_digests(tmp_path / "ref-0.txt")
    _, ref1 = read_digests(tmp_path / "ref-1.txt")
    assert ref0[steps] != ref1[steps]
