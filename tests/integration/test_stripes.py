"""Full checkpoints striped over several local drives (docs/format.md, "Striped full checkpoints").

Plain directories under tmp_path stand for the drives. The training is the helpers' tiny trainer
(in process) or ``python -m lowdiff.cli.demo train`` (a real process, SIGKILLed at a fault point),
compared byte for byte with the uninterrupted run.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from lowdiff_helpers import build, manifest_json, reference_digests, resumed_digest, train_steps, train_striped, wrap
from s3_helpers import listing

import lowdiff
import recovery
from lowdiff.cli import main as cli
from lowdiff.cli.demo import state_digest
from lowdiff.errors import MissingDeviceError
from lowdiff.format.fullckpt import read_full_index
from lowdiff.store.stripes import STRIPE_RE

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 16
TIMEOUT_S = 240   # only against hangs; nothing is timed




def _stripe_files(directory) -> set:
    return {n for n in os.listdir(directory) if STRIPE_RE.match(n)}


@pytest.fixture(scope="module")
def reference():
    return reference_digests(STEPS)


@pytest.fixture
def striped(tmp_path):
    """A directory trained STEPS steps with its full checkpoints striped over it and two more drives."""
    directory, devices = tmp_path / "ckpt", [tmp_path / "nvme1", tmp_path / "nvme2"]
    train_striped(directory, devices, STEPS)
    return directory, devices


def test_a_striped_run_resumes_exactly_and_retention_cleans_every_drive(striped, reference):
    directory, devices = striped
    manifest = manifest_json(directory)
    fulls = manifest["fulls"]
    assert len(fulls) == 3   # the helpers keep 4; steps 0, 6, 12 (and none retired yet)...
    for full in fulls:
        dirs = [s["dir"] for s in full["stripes"]]
        assert dirs == [None, str(devices[0]), str(devices[1])]
    # Every listed stripe is on its drive; no stripe of an unlisted checkpoint is left anywhere.
    named = {(s["dir"] or str(directory), s["file"]) for f in fulls for s in f["stripes"]}
    present = {(str(d), n) for d in [directory, *devices] for n in _stripe_files(d)}
    assert present == named
    # The checkpoint file itself holds no payload: its objects section follows the first page.
    for full in fulls:
        index = read_full_index(str(directory / full["file"]))
        assert index.objects.offset == 4096 and index.payload_bytes == sum(s["nbytes"] for s in full["stripes"])
    result, digest = resumed_digest(directory)
    assert int(result) == STEPS and digest == reference[STEPS]
    # Retention: keep 1 from here; a resumed run commits a new full checkpoint and retires the rest.
    train_striped(directory, devices, STEPS + 6, retention=lowdiff.KeepLast(1))
    fulls = manifest_json(directory)["fulls"]
    assert len(fulls) == 1
    named = {(s["dir"] or str(directory), s["file"]) for s in fulls[0]["stripes"]}
    present = {(str(d), n) for d in [directory, *devices] for n in _stripe_files(d)}
    assert present == named


def test_verify_inspect_and_export_of_a_striped_directory(striped, tmp_path, capsys):
    directory, _ = striped
    assert cli.main(["verify", str(directory)]) == 0
    assert cli.main(["inspect", str(directory)]) == 0
    out = tmp_path / "state.pt"
    assert cli.main(["export", str(directory), "--step", "9", "-o", str(out)]) == 0
    assert out.stat().st_size > 0
    capsys.readouterr()


def _newest_stripe(directory, number):
    full = max(manifest_json(directory)["fulls"], key=lambda f: f["step"])
    stripe = full["stripes"][number]
    return full, os.path.join(stripe["dir"] or str(directory), stripe["file"])


@pytest.mark.parametrize("damage", ["deleted", "truncated", "swapped"])
def test_a_damaged_stripe_falls_back_with_a_warning_naming_it(striped, reference, damage, caplog, capsys):
    directory, _ = striped
    full, path = _newest_stripe(directory, 1)
    if damage == "deleted":
        os.unlink(path)
    elif damage == "truncated":
        os.truncate(path, os.path.getsize(path) - 4096)
    else:   # the same stripe of the previous checkpoint, same size, under this one's name
        older = sorted(manifest_json(directory)["fulls"], key=lambda f: f["step"])[-2]
        stripe = older["stripes"][1]
        shutil.copyfile(os.path.join(stripe["dir"], stripe["file"]), path)
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        result, digest = resumed_digest(directory)
    # The older full checkpoint's chain reaches the same step: nothing is lost.
    assert int(result) == STEPS and digest == reference[STEPS]
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert full["file"] in warned and "falling back" in warned
    if damage != "swapped":   # (a swapped stripe is found by its tensors' checksums, named by the file)
        assert os.path.basename(path) in warned
    assert cli.main(["verify", str(directory)]) != 0
    capsys.readouterr()


def test_verify_checks_each_stripe_files_crc(striped, capsys):
    """Bytes no tensor covers (the padding between tensors) are checked by the stripe's CRC-32C."""
    directory, _ = striped
    full, path = _newest_stripe(directory, 0)
    index = read_full_index(str(directory / full["file"]))
    ends = sorted(e.offset - 4096 + e.nbytes for e in index.tensors)
    starts = {e.offset - 4096 for e in index.tensors}
    # a padding byte of the payload (after a tensor, before the next one) that lies in stripe 0
    gap = next(end for end in ends if end not in starts and end < index.payload_bytes
               and (end // index.stripe_bytes) % len(index.stripes) == 0)
    at = (gap // index.stripe_bytes // len(index.stripes)) * index.stripe_bytes + gap % index.stripe_bytes
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(b"\xff")
    assert cli.main(["verify", str(directory)]) != 0
    assert "fails its CRC-32C" in capsys.readouterr().out
    assert int(resumed_digest(directory)[0]) == STEPS   # (a resume uses tensor bytes only)


def test_a_missing_drive_is_refused_by_name_and_nothing_is_deleted(striped):
    directory, devices = striped
    before = {str(d): sorted(os.listdir(d)) for d in [directory, devices[0]]}
    moved = devices[1].with_name("nvme2-unmounted")
    devices[1].rename(moved)
    with pytest.raises(MissingDeviceError, match=str(devices[1])):
        resumed_digest(directory)
    with pytest.raises(MissingDeviceError, match=str(devices[1])):   # a trainer refuses to start too
        train_striped(directory, devices, STEPS + 2)
    assert not devices[1].exists()   # not created empty
    assert {str(d): sorted(os.listdir(d)) for d in [directory, devices[0]]} == before
    moved.rename(devices[1])
    result, _ = resumed_digest(directory)
    assert int(result) == STEPS


def test_stripe_dirs_are_checked():
    with pytest.raises(ValueError, match="stripe_dirs"):
        lowdiff.Options(stripe_dirs="/mnt/nvme1")


def test_a_striped_directory_drains_to_an_object_store_unstriped(s3, tmp_path, reference):
    """Each striped full checkpoint is uploaded as one ordinary file (gathered in a scratch
    directory, removed after), each batch from its drive: the bucket alone resumes exactly, with
    the node's drives gone. (A shared directory: tests/integration/test_stripe_batches.py.)"""
    directory, devices = tmp_path / "ckpt", [tmp_path / "nvme1", tmp_path / "nvme2"]
    url = f"s3://{s3.bucket}/run"
    train_striped(directory, devices, STEPS, tiers=lowdiff.Tiers(url))
    assert any(f["stripes"] for f in manifest_json(directory)["fulls"])
    assert any(b.get("dir") for b in manifest_json(directory)["batches"])
    keys = [k.removeprefix("run/") for k in listing(s3.client, s3.bucket, "run/")]
    assert any(k.startswith("full-") for k in keys) and not any(k.endswith(".lds") for k in keys)
    assert not any(n.startswith(".upload-") for n in os.listdir(directory))
    for path in [directory, *devices]:
        shutil.rmtree(path)
    model, opt, sched, sampler = build()
    torch.manual_seed(4321)
    result = recovery.resume(str(tmp_path / "node2"), model, opt, scheduler=sched, extra_state={"sampler": sampler},
                             shared_dir=url)
    assert int(result) == STEPS and state_digest(model, opt, sched, sampler) == reference[STEPS]


def test_a_dead_drainers_scratch_copy_is_removed(tmp_path):
    from lowdiff.tiers.unstripe import remove_dead_scratch, scratch_directory

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (tmp_path / f".upload-{int(dead.stdout)}").mkdir()
    (tmp_path / f".upload-{int(dead.stdout)}" / "full-000000000006-0a1b2c3d.ldf").write_bytes(b"partial")
    mine = scratch_directory(str(tmp_path))
    (tmp_path / ".upload-x").mkdir()   # not of our form: not ours
    remove_dead_scratch(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(mine), ".upload-x"])


def test_the_same_drive_twice_is_refused(tmp_path):
    model, opt, sched, sampler = build()
    with pytest.raises(ValueError, match="given twice"):
        wrap(str(tmp_path / "ckpt"), model, opt, sched, sampler,
             options=lowdiff.Options(stripe_dirs=(str(tmp_path / "a"), str(tmp_path / "a"))))


# ------------------------------------------------------------------ a real process, SIGKILLed
def _demo(directory, devices, steps, digests, fault=None):
    env = {k: v for k, v in os.environ.items() if k != "LOWDIFF_FAULT"}
    env["PYTHONPATH"] = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    if fault:
        env["LOWDIFF_FAULT"] = fault
    args = [sys.executable, "-m", "lowdiff.cli.demo", "train", str(directory), "--steps", str(steps),
            "--full-every", "5", "--batch-steps", "2", "--digests", str(digests)]
    for device in devices:
        args += ["--stripe-dir", str(device)]
    return subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def demo_reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "digests.txt"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-m", "lowdiff.cli.demo", "reference", "--steps", "20", "--digests", str(path)],
                   env=env, cwd=REPO, check=True, capture_output=True, timeout=TIMEOUT_S)
    return dict(line.split() for line in path.read_text().splitlines())


# stripe-write:5 — the 2nd stripe of the 2nd full checkpoint (3 drives): its 1st stripe is
# committed, the rest, the checkpoint file and the manifest are not. full-write:2: every stripe is
# committed, the checkpoint file is not. full-commit:2: every stripe and the checkpoint file are
# committed, the manifest does not list it yet (it is adopted). manifest-commit:4, retention:2: a
# commit that retires a striped checkpoint, killed before or between its deletions.
# Two kill points run by default (mid-stripe and at the commit that adopts a striped checkpoint);
# the rest with -m soak, to keep the suite near ten minutes on two cores.
@pytest.mark.parametrize("fault", ["stripe-write:5", "manifest-commit:4",
                                   *(pytest.param(f, marks=pytest.mark.soak)
                                     for f in ("full-write:2", "full-commit:2", "retention:2"))])
def test_sigkill_during_striped_writes_resumes_exactly(tmp_path, demo_reference, fault):
    directory, devices = tmp_path / "ckpt", [tmp_path / "nvme1", tmp_path / "nvme2"]
    digests = tmp_path / "digests.txt"
    killed = _demo(directory, devices, 20, digests, fault=fault)
    assert killed.returncode == -9, killed.stderr[-2000:]
    fulls = manifest_json(directory)["fulls"]
    listed = {s["file"] for f in fulls for s in f["stripes"]}
    if fault == "retention:2":
        # Killed between the deletions of the first retired checkpoint's stripes: its file is
        # still there (retired, naming the stripes left), and so is one stripe of it.
        assert [n for n in os.listdir(directory) if n.startswith("full-000000000000-") and n.endswith(".ldf")]
        assert len([n for d in [directory, *devices] for n in _stripe_files(d)
                    if n.startswith("full-000000000000-")]) == 1
    if fault.startswith("stripe-write"):
        # Nothing partial adopted: the checkpoint whose stripes were being written is not listed,
        # and its committed stripe is named by nothing.
        assert all(f["step"] < 5 for f in fulls)
        assert any(n not in listed for d in [directory, *devices] for n in _stripe_files(d))
    finished = _demo(directory, devices, 20, digests)
    # Whatever retention retired is gone from every drive once the next trainer has run.
    listed = {s["file"] for f in manifest_json(directory)["fulls"] for s in f["stripes"]}
    retired_steps = {f["step"] for f in fulls} - {f["step"] for f in manifest_json(directory)["fulls"]}
    assert not [n for d in [directory, *devices] for n in _stripe_files(d)
                if n not in listed and int(n[5:17]) in retired_steps]
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert finished.stdout.startswith("resumed at step") or "resumed" not in finished.stdout
    last = digests.read_text().splitlines()[-1].split()
    assert last == ["20", demo_reference["20"]]
    assert cli.main(["verify", str(directory)]) == 0


def test_a_discarded_checkpoint_leaves_no_stripe(tmp_path):
    """A full checkpoint copied in the background and then discarded (the state changed in place
    outside step() during the copy) leaves none of its stripes on any drive."""
    directory, devices = tmp_path / "ckpt", [tmp_path / "nvme1"]
    model, opt, sched, sampler = build()
    opt = wrap(str(directory), model, opt, sched, sampler, options=lowdiff.Options(stripe_dirs=(str(devices[0]),)))
    import torch

    import recovery
    from lowdiff.cli.demo import forward_backward
    assert recovery.resume(str(directory), model, opt) == 0
    train_steps(model, opt, sched, sampler, 0, 6)        # the full checkpoint of step 6 is being copied
    with torch.no_grad():
        model[0].weight.mul_(0.5)
    forward_backward(model, sampler)
    with pytest.warns(RuntimeWarning) as caught:
        opt.step()
    assert any("step 6 is discarded" in str(w.message) for w in caught)
    opt.flush()
    steps = [f["step"] for f in manifest_json(directory)["fulls"]]
    assert 6 not in steps
    present = {n for d in [directory, *devices] for n in _stripe_files(d)}
    assert not [n for n in present if n.startswith("full-000000000006-")]
    assert present == {s["file"] for f in manifest_json(directory)["fulls"] for s in f["stripes"]}
    opt.close()
