"""Replica mode under SIGKILL: a real ``lowdiff.cli.demo train --replica`` process is killed (at a random
step, or by a fault point right after a replica checkpoint is committed), a new process resumes
from the newest persisted replica plus the differentials after it — at least at the newest step
the killed process reported durable — and every state from the resumed step to the end equals the
uninterrupted run's, byte for byte (digests of model, optimizer, scheduler, sampler and RNG)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lowdiff.cli import main as cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 30
TIMEOUT_S = 240  # only against hangs; nothing is timed
DIGEST_LINE = re.compile(r"^(\d+) ([0-9a-f]{64})$")
DURABLE = re.compile(r"^step \d+ loss \S+ durable (-?\d+)$")
CASES = {"adamw-clipped": ("adamw", []), "sgd-hooks": ("sgd", ["--no-clip"])}


def start(mode, tmp_path, name, optimizer, extra, directory=None, fault=None):
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("LOWDIFF_FAULT", None)
    if fault:
        env["LOWDIFF_FAULT"] = fault
    args = [sys.executable, "-m", "lowdiff.cli.demo", mode, *([str(directory)] if directory else []),
            "--steps", str(STEPS), "--optimizer", optimizer, "--compressor", "dense", *extra,
            "--digests", str(tmp_path / f"{name}.digests")]
    if mode == "train":
        args += ["--replica", "--full-every", "3", "--batch-steps", "2"]
    stderr = open(tmp_path / f"{name}.err", "w")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env, cwd=REPO)
    return proc, stderr


def finish(proc, stderr) -> tuple[int, list[str]]:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("the trainer hung") from None
    stderr.close()
    return proc.returncode, out.splitlines()


def digests(path: Path) -> dict:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            m = DIGEST_LINE.match(line.strip())
            if m:
                out[int(m.group(1))] = m.group(2)
    return out


def reported_durable(lines: list[str]) -> int:
    """The newest durable step the trainer printed (``step N loss L durable D``), 0 if none."""
    found = [int(m.group(1)) for m in map(DURABLE.search, lines) if m]
    return max(found, default=0)


def resumed_at(lines: list[str]) -> tuple[int, str | None]:
    for line in lines:
        if line.startswith("resumed at step "):
            _, _, _, step, digest = line.split()
            return int(step), digest
    return 0, None


# Each case and each way of killing once by default; the other two pairings with -m soak.
@pytest.mark.parametrize("case,how", [("adamw-clipped", "random-step"),
                                      pytest.param("adamw-clipped", "fault-point", marks=pytest.mark.soak),
                                      pytest.param("sgd-hooks", "random-step", marks=pytest.mark.soak),
                                      ("sgd-hooks", "fault-point")])
def test_replica_sigkill_then_resume_is_exact(tmp_path, rng, capsys, case, how):
    optimizer, extra = CASES[case]
    directory = tmp_path / "ckpt"
    reference = start("reference", tmp_path, "reference", optimizer, extra)
    if how == "fault-point":
        # SIGKILL right after the 4th full checkpoint file is committed (the base is the 1st),
        # before the manifest lists it.
        first, first_err = start("train", tmp_path, "first", optimizer, extra, directory, fault="full-commit:4")
        code, first_lines = finish(first, first_err)
        assert code == -signal.SIGKILL, (tmp_path / "first.err").read_text()
    else:
        kill_at = int(rng.integers(8, STEPS - 3))
        first, first_err = start("train", tmp_path, "first", optimizer, extra, directory)
        first_lines = []
        for line in first.stdout:
            first_lines.append(line.rstrip("\n"))
            if line.startswith(f"step {kill_at} "):
                break
        os.kill(first.pid, signal.SIGKILL)
        code, rest = finish(first, first_err)
        assert code == -signal.SIGKILL
        first_lines += rest
    durable = reported_durable(first_lines)
    assert durable > 0, first_lines[-3:]

    second, second_err = start("train", tmp_path, "second", optimizer, extra, directory)
    code, lines = finish(second, second_err)
    assert code == 0, (tmp_path / "second.err").read_text()
    code, _ = finish(*reference)
    assert code == 0, (tmp_path / "reference.err").read_text()
    expected = digests(tmp_path / "reference.digests")
    assert sorted(expected) == list(range(1, STEPS + 1))

    killed = digests(tmp_path / "first.digests")
    assert all(expected[s] == d for s, d in killed.items()), "replica mode changed the training it checkpoints"
    step, digest = resumed_at(lines)
    assert durable <= step <= max(killed) + 1, f"resumed at {step}, killed after {max(killed)}, durable {durable}"
    assert digest == expected[step], f"state after resuming at step {step} differs from the reference"
    after = digests(tmp_path / "second.digests")
    assert sorted(after) == list(range(step + 1, STEPS + 1))
    assert all(after[s] == expected[s] for s in after), "the resumed run diverged from the reference"
    assert cli.main(["verify", str(directory)]) == 0, capsys.readouterr().out
