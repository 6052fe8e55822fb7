"""Fault injection: crashes at every named point of the commit protocol, damaged files of every kind,
and a full filesystem. The contract, for each fault:

* resume lands on a state bit-identical to the uninterrupted run's at that step, never behind what
  was durable before the fault (or fails with a clear error);
* no checkpoint file that verifies is ever deleted, except files the committed manifest lists as
  ``retired`` (dropped by a committed manifest, deletion maybe not done yet).

Trainers are real ``python -m lowdiff.cli.demo train`` processes; a fault is ``LOWDIFF_FAULT=PHASE:N``
(lowdiff/faults.py), which makes the trainer SIGKILL itself the N-th time it reaches PHASE. The
uninterrupted run is ``python -m lowdiff.cli.demo reference``. Two trainers run side by side (see
``fault_helpers.run_scenarios``) to keep the default selection within CI budgets; longer random
crash chains are marked ``soak`` (``pytest -m soak``).

In-process training and resumes run with one torch thread, like the demo processes: the matmul
results (hence the digests) depend on the thread count.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from fault_helpers import (
    MANIFEST,
    RECORD_HEADER_SIZE,
    REPO,
    TIMEOUT_S,
    Trainer,
    assert_nothing_valid_deleted,
    batch_records,
    durable_step,
    env,
    flip_bit,
    full_tensor_ranges,
    inventory,
    raise_failures,
    read_digests,
    resume_like_a_restart,
    retired_entries,
    run_scenarios,
    verify,
)

import lowdiff
import recovery
from lowdiff import faults
from lowdiff.cli import demo
from lowdiff.cli.demo import build, compressor_from, forward_backward, state_digest

STEPS = 30                 # crash chains of the default selection
REF_STEPS = 40             # the reference run (soak chains train this far)
CHAIN_FULL_EVERY = 3       # small, so that retention (keep_full=2) deletes files every full checkpoint
CHAIN_BATCH_STEPS = 2
PHASES = faults.PHASES


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def seed(request, rng) -> int:
    """The seed of this test's ``rng`` (for failure messages)."""
    return dict(request.node.user_properties)["rng_seed"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run's digests {step: digest}, adamw + topk (the demo defaults). The process
    starts when the first test asks for the fixture; it is waited for on first use."""
    work = tmp_path_factory.mktemp("reference")
    path = work / "reference.digests"
    log = open(work / "reference.err", "w")
    proc = subprocess.Popen([sys.executable, "-m", "lowdiff.cli.demo", "reference", "--steps", str(REF_STEPS),
                             "--digests", str(path)], stdout=subprocess.DEVNULL, stderr=log, env=env(), cwd=REPO)
    cache: dict = {}

    def get() -> dict:
        if not cache:
            proc.wait(timeout=TIMEOUT_S)
            log.flush()
            assert proc.returncode == 0, Path(log.name).read_text()
            cache.update(read_digests(path))
            assert sorted(cache) == list(range(1, REF_STEPS + 1)), "the reference run is incomplete"
        return cache

    yield get
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    log.close()


# ====================================================================== crash chains
def reach_bound(phase: str, start: int, stop: int, full_every: int, batch_steps: int) -> int:
    """How many times at least a session resumed at ``start`` and training to ``stop`` reaches
    ``phase``: every step is recorded; a full checkpoint is taken at ``start`` (the base) and every
    ``full_every`` steps after it; a batch holds at most ``batch_steps`` records; every batch and
    every full checkpoint is committed by one manifest; from the third full checkpoint of a session
    on, each full checkpoint's commit drops the oldest kept one and the batches before it (at least
    two files, so retention deletes and passes between deletions)."""
    n = stop - start
    if n <= 0:
        return 0
    fulls = 1 + n // full_every
    batches = -(-n // batch_steps)
    return {"record": n, "batch-write": batches, "batch-commit": batches, "full-write": fulls,
            "full-commit": fulls, "manifest-write": fulls + batches, "manifest-commit": fulls + batches,
            "retention": max(0, fulls - 2)}[phase]


def choose_count(rng, phase, start, stop, full_every, batch_steps, share) -> int | None:
    """N for ``PHASE:N``: surely reached before ``stop`` and, if possible, within the first ``share``
    of the remaining steps (so the chain has room for more crashes). None if it cannot be reached."""
    hard = reach_bound(phase, start, stop, full_every, batch_steps)
    if hard < 1:
        return None
    soft = reach_bound(phase, start, start + max(1, int((stop - start) * share)), full_every, batch_steps)
    return int(rng.integers(1, max(1, min(soft, hard)) + 1))


RANDOM = "random"


def crash_chain(label, directory, workdir, crashes, rng, reference, *, steps, full_every, batch_steps):
    """One checkpoint directory through a chain of trainer processes that each SIGKILL themselves at
    a fault point (``crashes``: phase names, or RANDOM for a random reachable phase), then a run
    without a fault to ``steps``. A scenario for ``run_scenarios``: yields Trainers, gets Results.

    Before every restart: what is durable (the manifest), the inventory of files that verify, then
    the restart's wrap + resume in this process (lands on the durable step with the reference state;
    deletes no valid file that the manifest does not retire). After every run: it resumed at the
    durable step with the reference state, and every state it reported is the reference's."""
    history: list = []
    for run, phase in enumerate(list(crashes) + [None]):
        durable = durable_step(directory)
        expected = max(durable, 0)
        context = f"{label}: after {' -> '.join(history) if history else 'nothing'} (durable step {durable})"
        if run:
            before, retired = inventory(directory), retired_entries(directory)
            # a crash never leaves a damaged file under a checkpoint name (temp file + rename)
            broken = sorted(name for name, found in before.items() if not found.verifies)
            assert not broken, f"{context}: checkpoint files that do not verify: {broken}"
            step, digest, _ = resume_like_a_restart(directory, full_every=full_every, batch_steps=batch_steps)
            assert step >= expected, f"{context}: in-process resume went back to step {step}, behind the durable step"
            assert step == expected, f"{context}: in-process resume reached step {step}, not the durable step"
            assert step == 0 or digest == reference()[step], \
                f"{context}: in-process resume at step {step} differs from the uninterrupted run"
            assert_nothing_valid_deleted(directory, before, retired, f"{context}: in-process wrap + resume")
        fault = None
        if phase == RANDOM:
            reachable = [p for p in PHASES if reach_bound(p, expected, steps, full_every, batch_steps) >= 1]
            phase = str(rng.choice(reachable)) if reachable else None  # nothing left to crash in: the final run
        if phase is not None:
            share = 1 / (len(crashes) - run + 1)  # spread the crashes over the remaining steps
            count = choose_count(rng, phase, expected, steps, full_every, batch_steps, share)
            assert count is not None, f"{context}: test design: {phase} cannot be reached after step {expected}"
            fault = f"{phase}:{count}"
        name = f"{re.sub(r'[^A-Za-z0-9.-]+', '_', label)}-run{run + 1}"
        result = yield Trainer(str(directory), str(workdir), name, steps, full_every, batch_steps, fault=fault)
        what = f"{context}: run {run + 1} (LOWDIFF_FAULT={fault or 'unset'})"
        ref = reference()
        if fault:
            assert result.returncode != 0, \
                f"{what}: the fault never fired; the trainer ran to step {steps} and exited 0 ({result.tail()})"
            assert result.returncode == -9, f"{what}: exited {result.returncode}, not SIGKILL: {result.tail()}"
        else:
            assert result.returncode == 0, f"{what}: exited {result.returncode}: {result.tail()}"

        died_while_starting = fault is not None and result.resumed is None and not result.trained
        if not died_while_starting:
            resumed, digest = result.resumed or (0, None)
            assert resumed >= expected, \
                f"{what}: resumed at step {resumed}, behind the durable step {expected} ({result.tail()})"
            assert resumed == expected, f"{what}: resumed at step {resumed}, not at the durable step {expected}"
            assert resumed == 0 or digest == ref[resumed], \
                f"{what}: the state resumed at step {resumed} differs from the uninterrupted run's"
            assert not result.trained or result.trained[0] == resumed + 1, \
                f"{what}: resumed at {resumed} but trained step {result.trained[0]} first"
        for s, d in sorted(result.digests.items()):
            assert d == ref[s], f"{what}: the state after step {s} differs from the uninterrupted run's"
        if fault is None:
            assert result.digests.get(steps) == ref[steps], \
                f"{what}: the final state at step {steps} is not the uninterrupted run's"
        history.append(f"{fault or 'no fault'} (resumed at {result.resumed[0] if result.resumed else 0})")
        if fault is None:
            break

    where = f"{label}: after {' -> '.join(history)}"
    assert durable_step(directory) == steps, f"{where}: the durable step is not {steps}"
    status, lines = verify(directory)
    assert status == 0, f"{where}: verify failed: {lines}"


@pytest.mark.parametrize("draw", [1, pytest.param(2, marks=pytest.mark.soak)])
def test_crash_chains_cover_every_phase(tmp_path, rng, seed, reference, draw):
    """Two directories side by side, each through four crashes and a final run; the eight phases,
    in an order drawn from ``rng``, are split between them, so every phase is hit once per draw
    (once per run of the default selection; with -m soak a second draw, at other points of a chain)."""
    order = [str(p) for p in rng.permutation(PHASES)]
    scenarios = {}
    for n, crashes in enumerate((order[:4], order[4:])):
        label = f"chain {n} ({' -> '.join(crashes)}, seed {seed})"
        scenarios[label] = crash_chain(label, tmp_path / f"chain{n}", tmp_path, crashes, rng, reference,
                                       steps=STEPS, full_every=CHAIN_FULL_EVERY, batch_steps=CHAIN_BATCH_STEPS)
    raise_failures(run_scenarios(scenarios))


@pytest.mark.soak
@pytest.mark.parametrize("chain_seed", range(5))
def test_random_crash_chains(tmp_path, rng, seed, reference, chain_seed):
    """Two chains of 5-8 crashes at random phases and counts, random checkpoint settings."""
    scenarios = {}
    for n in range(2):
        full_every, batch_steps = int(rng.choice([3, 4, 5])), int(rng.integers(1, 4))
        crashes = int(rng.integers(5, 9))
        label = f"soak chain {n} ({crashes} crashes, full_every {full_every}, batch_steps {batch_steps}, " \
                f"seed {seed})"
        scenarios[label] = crash_chain(label, tmp_path / f"chain{n}", tmp_path, [RANDOM] * crashes, rng, reference,
                                       steps=REF_STEPS, full_every=full_every, batch_steps=batch_steps)
    raise_failures(run_scenarios(scenarios))


# ====================================================================== damaged files
DAMAGE_FULL_EVERY, DAMAGE_BATCH_STEPS = 6, 3
DAMAGE_TRAIN_TO = 24       # a trainer resumed in a damaged directory trains on to this step
FIRST_SESSION_STEPS, LAST_STEP = 9, 20
# session 1 trains 1..9, session 2 resumes at 9 and trains to 20. Kept: fulls 9 (session 2's base)
# and 15; batches 10-12, 13-15 (the fallback chain from 9) and 16-18, 19-20 (the newest chain).
LAYOUT = {"fulls": [9, 15], "batches": [(10, 12), (13, 15), (16, 18), (19, 20)]}


@dataclasses.dataclass
class Pristine:
    directory: str
    other: str               # the same schedule trained with SGD: another run's files
    stale_manifest: bytes    # MANIFEST.json after session 1
    fulls: dict              # step -> file name
    batches: dict            # (first, last) -> file name
    other_fulls: dict
    other_batches: dict

    def role(self, role: str) -> str:
        """The file a damage case targets. The demo keeps two full checkpoints (keep_full=2), so the
        "middle" full checkpoint is the older kept one (resume needs it only as a fallback); the
        middle batch is the one between the newest full checkpoint and the newest batch."""
        newest_full = max(self.fulls)
        newest_batch = max(self.batches, key=lambda b: b[1])
        middle_batch = next(b for b in self.batches if b[0] == newest_full + 1 and b != newest_batch)
        return {"full-newest": self.fulls[newest_full], "full-middle": self.fulls[min(self.fulls)],
                "batch-newest": self.batches[newest_batch], "batch-middle": self.batches[middle_batch],
                "manifest": MANIFEST}[role]

    def on_resume_path(self) -> set:
        """The files a resume of the pristine directory reads: the newest full checkpoint and the
        chain of batches after it."""
        cursor = max(self.fulls)
        names = {self.fulls[cursor]}
        while (b := next((b for b in self.batches if b[0] == cursor + 1), None)) is not None:
            names.add(self.batches[b])
            cursor = b[1]
        return names


def _listed(directory) -> tuple[dict, dict]:
    with open(os.path.join(directory, MANIFEST), "rb") as f:
        body = json.loads(f.read())["manifest"]
    return ({e["step"]: e["file"] for e in body["fulls"]},
            {(e["first"], e["last"]): e["file"] for e in body["batches"]})


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, reference) -> Pristine:
    """Two clean sessions in this process (demo.train, the demo trainer's own code), for the main
    run (AdamW) and another run (SGD, same schedule)."""
    work = tmp_path_factory.mktemp("pristine")
    main, other = str(work / "main"), str(work / "other")
    options = dict(full_every=DAMAGE_FULL_EVERY, batch_steps=DAMAGE_BATCH_STEPS, log=lambda message: None)
    first = demo.train(main, FIRST_SESSION_STEPS, **options)
    with open(os.path.join(main, MANIFEST), "rb") as f:
        stale = f.read()
    second = demo.train(main, LAST_STEP, **options)
    assert second["start"] == FIRST_SESSION_STEPS
    demo.train(other, FIRST_SESSION_STEPS, optimizer="sgd", **options)
    demo.train(other, LAST_STEP, optimizer="sgd", **options)
    ref = reference()
    for step, digest in {**first["digests"], **second["digests"]}.items():
        assert digest == ref[step], f"pristine run: the state after step {step} differs from the reference"
    fulls, batches = _listed(main)
    other_fulls, other_batches = _listed(other)
    for name, listed in (("main", (fulls, batches)), ("other", (other_fulls, other_batches))):
        assert (sorted(listed[0]), sorted(listed[1])) == (LAYOUT["fulls"], LAYOUT["batches"]), \
            f"the {name} pristine run has an unexpected layout: {listed} (the cases below assume {LAYOUT})"
    return Pristine(main, other, stale, fulls, batches, other_fulls, other_batches)


def newest_reachable(fulls_ok, batch_ends: dict) -> int:
    """The newest step reachable from a full checkpoint that verifies through batches each valid
    up to ``batch_ends[(first, last)]``."""
    best = -1
    for cursor in fulls_ok:
        while (b := next((b for b in batch_ends if b[0] == cursor + 1), None)) is not None:
            end = batch_ends[b]
            cursor = max(cursor, end)
            if end < b[1]:
                break
        best = max(best, cursor)
    return best


def apply_damage(pristine: Pristine, directory: str, role: str, mode: str, rng) -> tuple[str, int, str]:
    """Damage the ``role`` file of a copy of the pristine directory. Returns (file name, the newest
    step still reachable, what was done)."""
    name = pristine.role(role)
    path = os.path.join(directory, name)
    fulls_ok = set(pristine.fulls)
    batch_ends = {b: b[1] for b in pristine.batches}
    step_of = {v: k for k, v in pristine.fulls.items()}
    range_of = {v: k for k, v in pristine.batches.items()}
    if role == "manifest":
        size = os.path.getsize(path)
        if mode == "flip":
            offset, bit = int(rng.integers(0, size)), int(rng.integers(0, 8))
            flip_bit(path, offset, bit)
            what = f"bit {bit} of byte {offset} flipped"
        elif mode == "truncate":
            offset = int(rng.integers(0, size))
            os.truncate(path, offset)
            what = f"truncated to {offset} bytes"
        elif mode == "delete":
            os.unlink(path)
            what = "deleted"
        elif mode == "foreign":
            shutil.copyfile(os.path.join(pristine.other, MANIFEST), path)
            what = "replaced by the SGD run's manifest"
        else:
            with open(path, "wb") as f:
                f.write(pristine.stale_manifest)
            what = f"replaced by the manifest saved after step {FIRST_SESSION_STEPS}"
        return name, LAST_STEP, what

    if mode == "delete":
        os.unlink(path)
        what = "deleted"
        if name in step_of:
            fulls_ok.discard(step_of[name])
        else:
            batch_ends[range_of[name]] = range_of[name][0] - 1
    elif mode == "foreign":
        if name in step_of:
            source = pristine.other_fulls[step_of[name]]
            fulls_ok.discard(step_of[name])
        else:
            source = pristine.other_batches[range_of[name]]
            batch_ends[range_of[name]] = range_of[name][0] - 1
        shutil.copyfile(os.path.join(pristine.other, source), path)
        what = f"replaced by the SGD run's {source}"
    elif name in step_of:  # a full checkpoint: any flip inside a tensor, any truncation, is fatal
        fulls_ok.discard(step_of[name])
        if mode == "flip":
            ranges = full_tensor_ranges(path)
            start, end = ranges[int(rng.integers(0, len(ranges)))]
            offset, bit = int(rng.integers(start, end)), int(rng.integers(0, 8))
            flip_bit(path, offset, bit)
            what = f"bit {bit} of byte {offset} (inside tensor data at {start}..{end}) flipped"
        else:
            offset = int(rng.integers(1, os.path.getsize(path)))
            os.truncate(path, offset)
            what = f"truncated to {offset} bytes"
    else:  # a batch: the records before the damaged one stay usable
        records = batch_records(path)
        first = records[0][0]
        if mode == "flip":
            position = int(rng.integers(0, len(records)))
            _, start, nbytes = records[position]
            offset, bit = int(rng.integers(start + RECORD_HEADER_SIZE, start + nbytes)), int(rng.integers(0, 8))
            flip_bit(path, offset, bit)
            batch_ends[range_of[name]] = first - 1 + position
            what = f"bit {bit} of byte {offset} (record {position}, step {first + position}) flipped"
        else:
            end_of_records = records[-1][1] + records[-1][2]
            offset = int(rng.integers(records[0][1], end_of_records))
            os.truncate(path, offset)
            intact = sum(1 for _, start, nbytes in records if start + nbytes <= offset)
            batch_ends[range_of[name]] = first - 1 + intact
            what = f"truncated to {offset} bytes ({intact} of {len(records)} records intact)"
    return name, newest_reachable(fulls_ok, batch_ends), what


def warning_required(pristine: Pristine, role: str) -> bool:
    """Resume must say so when a file it needs is damaged: the manifest, the newest full checkpoint
    and the batches after it. (An older full checkpoint that is not needed need not be read.)"""
    return role == "manifest" or pristine.role(role) in pristine.on_resume_path()


def check_verify_reports(status, lines, name, mode, where) -> None:
    if mode == "stale":
        assert status == 0, f"{where}: a stale manifest is not damage (the files verify), verify says {lines}"
    else:
        assert status == 1, f"{where}: verify did not report the damage: {lines}"
        assert any(name in line and not line.startswith("ok ") for line in lines), \
            f"{where}: verify does not name {name} as a problem: {lines}"


ROLES = ["full-newest", "full-middle", "batch-newest", "batch-middle"]
CASES = [(role, mode) for role in ROLES for mode in ("flip", "truncate", "delete", "foreign")] + \
        [("manifest", mode) for mode in ("flip", "truncate", "delete", "foreign", "stale")]


@pytest.mark.parametrize("role,mode", CASES, ids=[f"{r}-{m}" for r, m in CASES])
def test_damage_then_resume(pristine, tmp_path, rng, seed, reference, role, mode):
    directory = str(tmp_path / "ckpt")
    shutil.copytree(pristine.directory, directory)
    name, expected, what = apply_damage(pristine, directory, role, mode, rng)
    where = f"{role} {name} {what} (seed {seed})"
    verified = verify(directory)  # before wrap(), which may repair what it reports

    before, retired = inventory(directory), retired_entries(directory)
    broken = {n for n, found in before.items() if not found.verifies}
    assert broken == ({name} if role != "manifest" and mode != "delete" else set()), \
        f"{where}: the test's own check finds these files invalid: {sorted(broken)}"
    step, digest, messages = resume_like_a_restart(directory, full_every=DAMAGE_FULL_EVERY,
                                                   batch_steps=DAMAGE_BATCH_STEPS)
    assert step == expected, f"{where}: resumed at step {step}, the newest reachable step is {expected}"
    assert digest == reference()[step], f"{where}: the state resumed at step {step} differs from the reference"
    if warning_required(pristine, role):
        assert any(name in m for m in messages), f"{where}: no warning names {name}: {messages}"
    assert_nothing_valid_deleted(directory, before, retired, f"{where}: wrap + resume")
    check_verify_reports(*verified, name, mode, where)


SUBPROCESS_CASES = [("full-newest", "flip"), ("batch-middle", "truncate"), ("manifest", "stale")]


def damaged_trainer(pristine, tmp_path, role, mode, rng, reference, seed):
    directory = str(tmp_path / f"{role}-{mode}")
    shutil.copytree(pristine.directory, directory)
    name, expected, what = apply_damage(pristine, directory, role, mode, rng)
    where = f"{role} {name} {what} (seed {seed})"
    verified = verify(directory)
    result = yield Trainer(directory, str(tmp_path), f"{role}-{mode}", DAMAGE_TRAIN_TO, DAMAGE_FULL_EVERY,
                           DAMAGE_BATCH_STEPS)
    assert result.returncode == 0, f"{where}: the trainer failed: {result.tail()}"
    assert result.resumed is not None, f"{where}: the trainer did not resume: {result.tail()}"
    step, digest = result.resumed
    assert step == expected, f"{where}: resumed at step {step}, the newest reachable step is {expected}"
    ref = reference()
    assert digest == ref[step], f"{where}: the state resumed at step {step} differs from the reference"
    assert sorted(result.digests) == list(range(step + 1, DAMAGE_TRAIN_TO + 1)), f"{where}: {result.tail()}"
    for s, d in result.digests.items():
        assert d == ref[s], f"{where}: after resuming, step {s} differs from the uninterrupted run"
    if warning_required(pristine, role):
        assert any(name in line for line in result.stderr.splitlines()), \
            f"{where}: the trainer logged no warning naming {name}: {result.stderr[-1500:]}"
    check_verify_reports(*verified, name, mode, where)


def test_damage_then_resume_in_a_real_trainer(pristine, tmp_path, rng, seed, reference):
    """A few damage cases through a real trainer process that resumes and trains on."""
    scenarios = {f"{role}-{mode}": damaged_trainer(pristine, tmp_path, role, mode, rng, reference, seed)
                 for role, mode in SUBPROCESS_CASES}
    raise_failures(run_scenarios(scenarios, parallel=len(scenarios)))


# ====================================================================== a full filesystem
@pytest.fixture(scope="module")
def local_reference() -> dict:
    """In-process reference digests (same training without lowdiff, one torch thread), with the
    state before the first step as step 0."""
    model, opt, sched, sampler = build()
    digests = {0: state_digest(model, opt, sched, sampler)}
    digests.update(demo.train(None, 60, log=lambda message: None)["digests"])
    return digests


LOWDIFF_FILE = re.compile(r"(full-\d{12}-[0-9a-f]{8}\.ldf|diff-\d{12}-\d{12}-[0-9a-f]{8}\.ldd|MANIFEST\.json)")
# (full_every, batch_steps, KiB of free space): "full" runs out writing the third full checkpoint
# (two of ~0.94 MiB are kept), "batch" fills the space after the base checkpoint with batches.
FULL_FS = {"full": (3, 2, (2200, 2700)), "batch": (1000, 2, (1100, 1500))}
FILLER_KIB = 512


def _mount_tmpfs(path, kib: int) -> None:
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")


def _unmount(path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _raises_enospc(call, what, where) -> None:
    try:
        call()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, f"{where}: {what} raised errno {exc.errno}, not ENOSPC: {exc}"
        return
    raise AssertionError(f"{where}: {what} succeeded after a write failed with ENOSPC (the error is not sticky)")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root (an injected ENOSPC is tested in "
                                              "test_fastio_failures.py)")
@pytest.mark.parametrize("variant", sorted(FULL_FS))
def test_full_filesystem(tmp_path, rng, seed, local_reference, variant):
    full_every, batch_steps, (low, high) = FULL_FS[variant]
    free_kib = int(rng.integers(low, high))
    where = (f"{variant}: tmpfs with {free_kib} KiB free, full_every {full_every}, batch_steps {batch_steps} "
             f"(seed {seed})")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    _mount_tmpfs(mount, free_kib + FILLER_KIB)
    directory = str(mount / "ckpt")
    copy = str(tmp_path / "copy")
    try:
        filler = mount / "filler"
        with open(filler, "wb") as f:
            f.write(b"\xff" * (FILLER_KIB * 1024))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model, opt, sched, sampler = build()
            opt = lowdiff.wrap(opt, model, directory, compressor=compressor_from("topk", 0.05), full_every=full_every,
                               batch_steps=batch_steps, scheduler=sched, extra_state={"sampler": sampler})
            try:
                assert recovery.resume(directory, model, opt) == 0
                error, steps = None, 0
                while error is None and steps < 60:
                    forward_backward(model, sampler)
                    try:
                        opt.step()
                    except OSError as exc:
                        error = exc
                    opt.zero_grad()
                    steps += 1
                if error is None:
                    try:
                        opt.flush()
                    except OSError as exc:
                        error = exc
                assert error is not None, f"{where}: {steps} steps and a flush never ran out of space"
                where += f", first error at step {steps}: {error}"
                assert error.errno == errno.ENOSPC, f"{where}: not ENOSPC"
                assert directory + os.sep in str(error) or LOWDIFF_FILE.search(str(error)), \
                    f"{where}: the error does not name a file in {directory}"

                os.unlink(filler)  # space is back: only a sticky error still fails what follows
                for n in range(2):
                    forward_backward(model, sampler)
                    _raises_enospc(opt.step, f"step() #{n + 1} after the error", where)
                    opt.zero_grad()
                _raises_enospc(opt.flush, "flush()", where)
                _raises_enospc(opt.flush, "a second flush()", where)
                _raises_enospc(opt.close, "close()", where)
                durable = opt.durable_step
            finally:
                try:
                    opt.close()
                except OSError:
                    pass
        outside = [str(w.message) for w in caught if "outside" in str(w.message)]
        assert not outside, f"{where}: warned about changes outside step(): {outside}"
        shutil.copytree(directory, copy)
    finally:
        _unmount(mount)

    model, opt, sched, sampler = build()
    torch.manual_seed(4242)
    step = recovery.resume(copy, model, opt, scheduler=sched, extra_state={"sampler": sampler})
    assert step == durable, f"{where}: durable_step said {durable}, resume reached {step}"
    assert state_digest(model, opt, sched, sampler) == local_reference[step], \
        f"{where}: the state resumed at step {step} differs from the uninterrupted run's"
