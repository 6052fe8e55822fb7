"""Issue #33, 4: files a stopped commit left unlisted are worded as what they are. After a SIGKILL
between a file's commit and the manifest's, resume used to warn that "the manifest is older than
the files?", pointing the user at a backup restore that never happened; a manifest put back from a
copy keeps a warning that says so. Either way the files are used and the state is exact."""
import dataclasses
import logging
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(__file__))
from lowdiff_helpers import build, reference_digests, resumed_digest, train_directory, train_steps, wrap  # noqa: E402

from lowdiff.store.inventory import take_inventory  # noqa: E402
from lowdiff.store.manifest import read_manifest, write_manifest  # noqa: E402

STEPS = 20


def _resume_notes(directory, caplog):
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        result, digest = resumed_digest(directory)
    return int(result), digest, [r.getMessage() for r in caplog.records]


def test_a_commit_stopped_before_the_manifest_is_named_as_such(tmp_path, caplog):
    directory = train_directory(str(tmp_path / "ckpt"), STEPS)
    manifest = read_manifest(directory)
    newest = max(manifest.batches, key=lambda b: b.last)
    assert newest.last == STEPS
    # The newest batch's file is in place, the manifest commit that lists it never happened.
    write_manifest(directory, dataclasses.replace(manifest, batches=[b for b in manifest.batches if b is not newest]))
    notes = take_inventory(directory).notes
    assert any("written after the last commit of MANIFEST.json" in n and newest.file in n for n in notes), notes
    assert not any("put back" in n or "older than the files" in n for n in notes), notes
    step, digest, said = _resume_notes(directory, caplog)
    assert step == STEPS and digest == reference_digests(STEPS)[STEPS]
    assert any("written after the last commit" in m for m in said), said
    assert not any("put back" in m or "older than the files" in m for m in said), said


def test_a_manifest_put_back_from_a_copy_is_named_as_such(tmp_path):
    directory = str(tmp_path / "ckpt")
    model, opt, sched, sampler = build()
    opt = wrap(directory, model, opt, sched, sampler)
    train_steps(model, opt, sched, sampler, 0, 8)
    opt.flush()
    shutil.copy(os.path.join(directory, "MANIFEST.json"), tmp_path / "copy.json")
    train_steps(model, opt, sched, sampler, 8, STEPS)
    opt.close()
    shutil.copy(tmp_path / "copy.json", os.path.join(directory, "MANIFEST.json"))   # the copy put back
    notes = take_inventory(directory).notes
    assert any("put back from a copy" in n for n in notes), notes
    assert not any("written after the last commit" in n for n in notes), notes
