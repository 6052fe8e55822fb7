"""A run with full_every="auto", batch_steps="auto" and differentials="auto" (or with differentials
off), killed with SIGKILL and resumed in a new process, is exactly the uninterrupted run with fixed
settings (state digests byte for byte), and loses no more than the bound of the settings in force
(two batches of the size in force; without differentials, about two full-checkpoint intervals)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from lowdiff_helpers import BATCH_STEPS, FULL_EVERY, build, train_steps, wrap

import lowdiff
import recovery
from lowdiff.cli.demo import state_digest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
STEPS = 40
TIMEOUT_S = 240  # only against hangs; nothing is timed


def trainer(directory: str, settings: str, digests: str, pause_at: str = "0") -> None:
    """The child: resume, train to STEPS printing "step N B F R" (batch size and full interval in
    force, R 1 if the step recorded a differential) and appending "N digest" lines; with settings
    "auto" at a failure rate that makes the controller choose short intervals and small batches
    within these few steps (and turn differentials off if it finds them too dear); "off": full
    checkpoints only. After reporting step ``pause_at`` the training thread stops there (the
    writer threads go on) until the test kills it: the runs go side by side, and one must not race
    past its kill step, or finish, while the test is still reading the other's lines."""
    model, opt, sched, sampler = build()
    options = {"auto": {"schedule": lowdiff.Auto(differentials="auto", failure_rate_per_hour=3.6e5)},
               "off": {"schedule": lowdiff.Fixed(full_every=FULL_EVERY, batch_steps=BATCH_STEPS, differentials=False)},
               "fixed": {}}[settings]
    opt = wrap(directory, model, opt, sched, sampler, **options)
    start = recovery.resume(directory, model, opt)
    with open(digests, "a") as out:
        if start:
            print(f"resumed at step {start} {state_digest(model, opt, sched, sampler)}", flush=True)

        def report(step):
            out.write(f"{step} {state_digest(model, opt, sched, sampler)}\n")
            out.flush()
            print(f"step {step} {opt.controller.batch_steps} {opt.controller.full_every} "
                  f"{int(opt._session.recording)}", flush=True)
            if step == int(pause_at):
                time.sleep(TIMEOUT_S)

        train_steps(model, opt, sched, sampler, start, STEPS, report)
    opt.close()


def spawn(directory, settings, digests, pause_at=0):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, HERE, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), str(directory), settings, str(digests),
                             str(pause_at)],
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


def test_auto_and_full_only_runs_killed_and_resumed_equal_a_fixed_uninterrupted_run(tmp_path, rng):
    """Both settings run side by side (each its own directory and kill step) next to one reference."""
    reference = spawn(tmp_path / "fixed", "fixed", tmp_path / "fixed.txt")
    runs = ("auto", "off")
    kill_at = {s: int(rng.integers(12, STEPS - 5)) for s in runs}
    firsts = {s: spawn(tmp_path / s, s, tmp_path / f"{s}-first.txt", kill_at[s]) for s in runs}
    in_force, seconds = {}, {}
    for s, first in firsts.items():
        for line in first.stdout:
            _, step, *in_force[s] = line.split()
            if int(step) == kill_at[s]:
                first.send_signal(signal.SIGKILL)
                break
        _, err = first.communicate(timeout=TIMEOUT_S)
        assert first.returncode == -signal.SIGKILL, err
        seconds[s] = spawn(tmp_path / s, s, tmp_path / f"{s}-second.txt")
    _, err = reference.communicate(timeout=TIMEOUT_S)
    assert reference.returncode == 0, err
    fixed = digests_of(tmp_path / "fixed.txt")
    assert sorted(fixed) == list(range(1, STEPS + 1))

    for s, second in seconds.items():
        out, err = second.communicate(timeout=TIMEOUT_S)
        assert second.returncode == 0, err
        killed = digests_of(tmp_path / f"{s}-first.txt")
        assert all(fixed[k] == d for k, d in killed.items()), f"the {s} run differs from the fixed one before the kill"
        words = out.splitlines()[0].split()
        assert words[:3] == ["resumed", "at", "step"], out[:200]
        resumed, digest = int(words[3]), words[4]
        assert 0 < resumed <= kill_at[s] and digest == fixed[resumed]
        # The batch size may have changed just before the kill: allow the larger of the two in force.
        # Without differentials: the interval, and the one before if a full was still being written.
        batch_steps, full_every, recording = (int(v) for v in in_force[s])
        bound = 2 * max(batch_steps, 8) + 1 if recording else 2 * max(full_every, 6) + 1
        assert kill_at[s] - resumed <= bound, (s, in_force[s])
        after = digests_of(tmp_path / f"{s}-second.txt")
        assert sorted(after) == list(range(resumed + 1, STEPS + 1))
        assert all(after[k] == fixed[k] for k in after), f"the resumed {s} run diverged from the fixed run"


if __name__ == "__main__":
    trainer(*sys.argv[1:])
