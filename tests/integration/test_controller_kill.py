"""A run with full_every="auto" and batch_steps="auto", killed with SIGKILL and resumed in a new
process, is exactly the uninterrupted run with fixed settings (state digests byte for byte), and
loses no more than a fixed setting's bound (two batches of the size in force)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import recovery
from lowdiff.demo import state_digest
from lowdiff_helpers import build, train_steps, wrap

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STEPS = 40
TIMEOUT_S = 240  # only against hangs; nothing is timed


def trainer(directory: str, settings: str, digests: str) -> None:
    """The child: resume, train to STEPS printing "step N B" (B: batch size in force) and
    appending "N digest" lines; with settings "auto" at a failure rate that makes the controller
    choose short intervals and small batches within these few steps."""
    model, opt, sched, sampler = build()
    options = ({"full_every": "auto", "batch_steps": "auto", "failure_rate_per_hour": 3.6e5}
               if settings == "auto" else {})
    opt = wrap(directory, model, opt, sched, sampler, **options)
    start = recovery.resume(directory, model, opt)
    with open(digests, "a") as out:
        if start:
            print(f"resumed at step {start} {state_digest(model, opt, sched, sampler)}", flush=True)

        def report(step):
            out.write(f"{step} {state_digest(model, opt, sched, sampler)}\n")
            out.flush()
            print(f"step {step} {opt.controller.batch_steps}", flush=True)

        train_steps(model, opt, sched, sampler, start, STEPS, report)
    opt.close()


def spawn(directory, settings, digests):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), str(directory), settings, str(digests)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def digests_of(path) -> dict:
    out = {}
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        parts = line.split()
        if len(parts) == 2 and len(parts[1]) == 64:
            out[int(parts[0])] = parts[1]
    return out


def test_auto_run_killed_and_resumed_equals_a_fixed_uninterrupted_run(tmp_path, rng):
    reference = spawn(tmp_path / "fixed", "fixed", tmp_path / "fixed.txt")
    first = spawn(tmp_path / "auto", "auto", tmp_path / "first.txt")
    kill_at = int(rng.integers(12, STEPS - 5))
    batch_in_force = 0
    for line in first.stdout:
        _, step, batch_in_force = line.split()
        if int(step) == kill_at:
            first.send_signal(signal.SIGKILL)
            break
    _, err = first.communicate(timeout=TIMEOUT_S)
    assert first.returncode == -signal.SIGKILL, err
    second = spawn(tmp_path / "auto", "auto", tmp_path / "second.txt")
    out, err = second.communicate(timeout=TIMEOUT_S)
    assert second.returncode == 0, err
    _, err = reference.communicate(timeout=TIMEOUT_S)
    assert reference.returncode == 0, err

    fixed = digests_of(tmp_path / "fixed.txt")
    assert sorted(fixed) == list(range(1, STEPS + 1))
    killed = digests_of(tmp_path / "first.txt")
    assert all(fixed[s] == d for s, d in killed.items()), "the auto run differs from the fixed one before the kill"
    words = out.splitlines()[0].split()
    assert words[:3] == ["resumed", "at", "step"], out[:200]
    resumed, digest = int(words[3]), words[4]
    assert 0 < resumed <= kill_at + 1 and digest == fixed[resumed]
    # The batch size may have changed just before the kill: allow the larger of the two in force.
    assert kill_at - resumed <= 2 * max(int(batch_in_force), 8) + 1
    after = digests_of(tmp_path / "second.txt")
    assert sorted(after) == list(range(resumed + 1, STEPS + 1))
    assert all(after[s] == fixed[s] for s in after), "the resumed auto run diverged from the fixed run"


if __name__ == "__main__":
    trainer(*sys.argv[1:])
