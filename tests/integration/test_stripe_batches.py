"""Differential batches placed round robin over several local drives (docs/format.md, "Differential
batches on the drives").

Plain directories under tmp_path stand for the drives. The training is the helpers' tiny trainer (in
process) or ``python -m lowdiff.cli.demo train --stripe-dir`` (a real process, SIGKILLed at a fault
point), compared byte for byte with the uninterrupted run.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from lowdiff_helpers import build, manifest_json, reference_digests, resumed_digest, train_striped, wrap

import lowdiff
import recovery
from lowdiff.cli import main as cli
from lowdiff.errors import MissingDeviceError
from lowdiff.format.batchfile import BatchReader
from lowdiff.store.manifest import DIFF_RE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 16
TIMEOUT_S = 240   # only against hangs; nothing is timed




def _batch_files(drives) -> set:
    """(drive, name) of every batch file on ``drives``."""
    return {(str(d), n) for d in drives for n in os.listdir(d) if DIFF_RE.match(n)}


def _listed_batches(directory) -> set:
    return {(b.get("dir") or str(directory), b["file"]) for b in manifest_json(directory)["batches"]}


@pytest.fixture(scope="module")
def reference():
    return reference_digests(STEPS + 6)


@pytest.fixture
def striped(tmp_path):
    directory, devices = tmp_path / "ckpt", [tmp_path / "nvme1", tmp_path / "nvme2"]
    train_striped(directory, devices, STEPS)
    return directory, devices


def test_batches_go_to_the_drives_in_turn_and_resume_exactly(striped, reference, tmp_path, capsys):
    directory, devices = striped
    batches = manifest_json(directory)["batches"]
    # One session, batches in commit order: the checkpoint directory, then each drive, in turn. An
    # entry in the directory itself has no "dir" (its bytes are as without striping).
    drives = [None, str(devices[0]), str(devices[1])]
    assert [b.get("dir") for b in batches] == [drives[i % 3] for i in range(len(batches))]
    assert all("dir" not in b for b in batches[::3])
    # Every listed batch is on its drive, and nothing else is on any drive.
    assert _batch_files([directory, *devices]) == _listed_batches(directory)
    result, digest = resumed_digest(directory)
    assert int(result) == STEPS and digest == reference[STEPS]
    for step in (4, 8, 14):   # time travel through chains whose batches are on every drive
        assert resumed_digest(directory, step=step) == (step, reference[step])
    assert cli.main(["verify", str(directory)]) == 0
    assert cli.main(["inspect", str(directory)]) == 0
    assert f"on {devices[1]}" in capsys.readouterr().out
    out = tmp_path / "state.pt"
    assert cli.main(["export", str(directory), "--step", "11", "-o", str(out)]) == 0
    assert out.stat().st_size > 0
    capsys.readouterr()


def test_retention_removes_batches_on_every_drive(striped, reference):
    directory, devices = striped
    before = _batch_files(devices)
    assert before
    train_striped(directory, devices, STEPS + 6, retention=lowdiff.KeepLast(1))
    after = _batch_files([directory, *devices])
    assert after == _listed_batches(directory)
    assert not before & after   # every batch of the first session was retired, from its own drive
    result, digest = resumed_digest(directory)
    assert int(result) == STEPS + 6 and digest == reference[STEPS + 6]


def test_a_damaged_batch_on_the_second_drive_falls_back_to_its_valid_prefix(striped, reference, caplog):
    directory, devices = striped
    # The newest full checkpoint is of step 12; its chain is 13-15 (on the second drive) and 16.
    batch = next(b for b in manifest_json(directory)["batches"] if b["first"] == 13)
    assert (batch["dir"], batch["last"]) == (str(devices[0]), 15)
    path = os.path.join(batch["dir"], batch["file"])
    with BatchReader(path) as reader:
        _, offset, nbytes = reader.index.records[-1]
    os.truncate(path, offset + nbytes // 2)   # the record of step 15 torn, the index gone
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        result, digest = resumed_digest(directory)
    assert int(result) == 14 and digest == reference[14]
    assert path in " ".join(r.getMessage() for r in caplog.records)
    assert cli.main(["verify", str(directory)]) != 0


DRIVES = 12   # more than a tiny full checkpoint's payload has pages: some drives hold no stripe


def _tiny(directory, drives):
    """A tiny model, one batch per step, one full checkpoint (of step 0): its payload is striped over
    as many drives as it has pages (fewer than DRIVES), every batch goes to the next drive."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, str(directory), compressor=lowdiff.Dense(),
                       full_every=1000, batch_steps=1, options=lowdiff.Options(stripe_dirs=tuple(map(str, drives))))
    return model, opt


def test_a_batch_on_a_missing_drive_is_refused_by_name_and_nothing_is_deleted(tmp_path):
    directory, drives = tmp_path / "ckpt", [tmp_path / f"nvme{i}" for i in range(1, DRIVES)]
    model, opt = _tiny(directory, drives)
    assert recovery.resume(str(directory), model, opt) == 0
    for _ in range(DRIVES):
        model(torch.ones(3, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    manifest = manifest_json(directory)
    striped_on = {s["dir"] for f in manifest["fulls"] for s in f["stripes"]}
    # The last drive holds a batch of the chain, and no stripe: only a batch is missing without it.
    drive = drives[-1]
    assert str(drive) not in striped_on
    on_drive = [b["file"] for b in manifest["batches"] if b.get("dir") == str(drive)]
    assert len(on_drive) == 1
    before = {n: (directory / n).read_bytes() for n in os.listdir(directory) if n != "LOCK"}
    unmounted = drive.with_name("unmounted")
    drive.rename(unmounted)
    other = torch.nn.Linear(4, 2)
    with pytest.raises(MissingDeviceError, match=str(drive)) as caught:
        recovery.resume(str(directory), other, torch.optim.SGD(other.parameters(), lr=0.1))
    assert on_drive[0] in str(caught.value)
    with pytest.raises(MissingDeviceError, match=on_drive[0]):
        recovery.verify(str(directory))
    with pytest.raises(MissingDeviceError, match=on_drive[0]):   # a trainer refuses to start, naming it
        _tiny(directory, drives)
    assert not drive.exists()   # not created empty
    assert {n: (directory / n).read_bytes() for n in os.listdir(directory) if n != "LOCK"} == before
    unmounted.rename(drive)
    model, opt = _tiny(directory, drives)
    assert recovery.resume(str(directory), model, opt) == DRIVES
    opt.close()


# ------------------------------------------------------------------ a real process, SIGKILLed
def _demo(directory, devices, steps, digests, fault=None, shared=None):
    env = {k: v for k, v in os.environ.items() if k != "LOWDIFF_FAULT"}
    env["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    if fault:
        env["LOWDIFF_FAULT"] = fault
    args = [sys.executable, "-m", "lowdiff.cli.demo", "train", str(directory), "--steps", str(steps),
            "--full-every", "5", "--batch-steps", "2", "--digests", str(digests)]
    for device in devices:
        args += ["--stripe-dir", str(device)]
    if shared is not None:
        args += ["--shared-dir", str(shared)]
    return subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def demo_reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "digests.txt"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-m", "lowdiff.cli.demo", "reference", "--steps", "20", "--digests", str(path)],
                   env=env, cwd=REPO, check=True, capture_output=True, timeout=TIMEOUT_S)
    return dict(line.split() for line in path.read_text().splitlines())


# With --full-every 5 --batch-steps 2 and three drives, the batches go 1-2 (ckpt), 3-4 (nvme1),
# 5 (nvme2), 6-7 (ckpt), 8-9 (nvme1), 10 (nvme2), ... batch-write:2: killed while 3-4 is being
# written on nvme1 (its temporary file left there); batch-commit:5: 8-9 committed on nvme1, not yet
# listed (the next trainer adopts it); manifest-commit:7 and retention:3: a commit that retires
# batches on the drives, killed before or between the deletions.
# The adoption of a committed, unlisted batch on another drive runs by default; the other kill points
# with -m soak, to keep the suite near ten minutes on two cores.
@pytest.mark.parametrize("fault", ["batch-commit:5", *(pytest.param(f, marks=pytest.mark.soak)
                                                       for f in ("batch-write:2", "manifest-commit:7", "retention:3"))])
def test_sigkill_with_batches_on_the_drives_resumes_exactly(tmp_path, demo_reference, fault):
    directory, devices = tmp_path / "ckpt", [tmp_path / "nvme1", tmp_path / "nvme2"]
    drives = [directory, *devices]
    digests = tmp_path / "digests.txt"
    killed = _demo(directory, devices, 20, digests, fault=fault)
    assert killed.returncode == -9, killed.stderr[-2000:]
    if fault == "batch-write:2":
        assert [n for n in os.listdir(devices[0]) if n.startswith(".diff-000000000003-")]
    if fault == "batch-commit:5":
        unlisted = _batch_files(drives) - _listed_batches(directory)
        assert {(d, n[:31]) for d, n in unlisted} == {(str(devices[0]), "diff-000000000008-000000000009-")}
    finished = _demo(directory, devices, 20, digests)
    assert finished.returncode == 0, finished.stderr[-2000:]
    last = digests.read_text().splitlines()[-1].split()
    assert last == ["20", demo_reference["20"]]
    # Nothing left behind on any drive: every batch file is listed where it is (an unlisted one was
    # adopted or retired), no temporary file of the dead writer is left.
    assert _batch_files(drives) == _listed_batches(directory)
    assert not [n for d in drives for n in os.listdir(d) if n.startswith(".diff-")]
    assert cli.main(["verify", str(directory)]) == 0
    if fault == "batch-commit:5":   # the adopted batch carried the resume past step 9
        assert "resumed at step 9" in finished.stdout or "resumed at step 10" in finished.stdout


# ------------------------------------------------------------------ storage tiers
def test_a_striped_run_drains_to_a_shared_tier_that_resumes_alone(tmp_path, reference):
    """Striped full checkpoints are drained as unstriped ones and batches from their drives: the
    shared tier holds whole files only, and resumes exactly with the local drives gone."""
    directory, devices, shared = tmp_path / "ckpt", [tmp_path / "nvme1", tmp_path / "nvme2"], tmp_path / "shared"
    train_striped(directory, devices, STEPS, tiers=lowdiff.Tiers(str(shared), shared=lowdiff.KeepAll()))
    local, copied = manifest_json(directory), manifest_json(shared)
    assert any(f["stripes"] for f in local["fulls"]) and any(b.get("dir") for b in local["batches"])
    assert copied["fulls"] and all("stripes" not in f for f in copied["fulls"])
    assert copied["batches"] and all("dir" not in b for b in copied["batches"])
    assert {n for n in os.listdir(shared) if n.endswith((".ldf", ".ldd"))} == \
        {e["file"] for e in copied["fulls"] + copied["batches"]}
    assert not [n for n in os.listdir(shared) if n.endswith(".lds")]
    for full in copied["fulls"]:   # an unstriped file: the payload in it, the same tensors
        from lowdiff.format.fullckpt import read_full_index
        index = read_full_index(str(shared / full["file"]))
        assert not index.stripes and index.objects.offset == 4096 + index.payload_bytes
        assert full["nbytes"] == (shared / full["file"]).stat().st_size
    assert cli.main(["verify", str(shared)]) == 0
    # The node's drives are gone: the shared tier alone resumes exactly.
    for d in [directory, *devices]:
        d.rename(d.with_name(d.name + "-gone"))
    result, digest = resumed_digest(shared)
    assert int(result) == STEPS and digest == reference[STEPS]
    assert resumed_digest(shared, step=8) == (8, reference[8])


def test_a_damaged_stripe_is_not_drained(tmp_path):
    """A local stripe that fails its CRC-32C stops the drain with an error naming it; nothing of that
    checkpoint appears in the shared tier."""
    directory, devices, shared = tmp_path / "ckpt", [tmp_path / "nvme1"], tmp_path / "shared"
    train_striped(directory, devices, 4)
    full = max(manifest_json(directory)["fulls"], key=lambda f: f["step"])
    stripe = full["stripes"][1]
    path = os.path.join(stripe["dir"], stripe["file"])
    with open(path, "r+b") as f:
        f.seek(5)
        f.write(bytes([f.read(1)[0] ^ 0xFF]))
    model, opt, sched, sampler = build()
    with pytest.raises(Exception, match=stripe["file"]):   # (the drainer's error, at close)
        opt = wrap(str(directory), model, opt, sched, sampler, tiers=lowdiff.Tiers(str(shared)),
                   options=lowdiff.Options(stripe_dirs=tuple(map(str, devices))))
        opt.close()
    assert not (shared / full["file"]).exists()   # (nor a temporary file of it: the writer aborted)
    assert not [n for n in os.listdir(shared) if n.startswith(f".{full['file']}")]


# drain-write:1: killed with the unstriped copy of the first (striped) full checkpoint written under
# its temporary name in the shared tier; drain-commit:4: a copy committed there, not yet listed.
@pytest.mark.parametrize("fault", ["drain-commit:4", pytest.param("drain-write:1", marks=pytest.mark.soak)])
def test_sigkill_while_draining_a_striped_run_resumes_exactly(tmp_path, demo_reference, fault):
    directory, devices, shared = tmp_path / "ckpt", [tmp_path / "nvme1", tmp_path / "nvme2"], tmp_path / "shared"
    digests = tmp_path / "digests.txt"
    killed = _demo(directory, devices, 20, digests, fault=fault, shared=shared)
    assert killed.returncode == -9, killed.stderr[-2000:]
    finished = _demo(directory, devices, 20, digests, shared=shared)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert digests.read_text().splitlines()[-1].split() == ["20", demo_reference["20"]]
    assert not [n for n in os.listdir(shared) if ".tmp-" in n or n.endswith(".lds")]
    report = recovery.verify(str(shared))
    assert report.ok and report.newest_recoverable == 20, report.problems
    assert all("stripes" not in f for f in manifest_json(shared)["fulls"])
