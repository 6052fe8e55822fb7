"""recovery.verify: which steps are recoverable from which full checkpoint, every problem named,
the same answer with one worker or several."""
from __future__ import annotations

import os

from lowdiff_helpers import reference_digests, resumed_digest, train_directory

import recovery
from lowdiff.format.records import RECORD_HEADER
from lowdiff.store.manifest import read_manifest

STEPS = 23   # fulls 0, 6, 12, 18 (keep_full 4); batches of 3


def trained(tmp_path) -> str:
    return train_directory(str(tmp_path / "ckpt"), STEPS)


def test_a_pristine_directory_is_recoverable_from_every_full_checkpoint(tmp_path):
    directory = trained(tmp_path)
    report = recovery.verify(directory)
    assert report.ok and not report.problems
    assert [(full, last) for full, _, last in report.recoverable] == [(0, 23), (6, 23), (12, 23), (18, 23)]
    assert report.newest_listed == report.newest_recoverable == STEPS
    assert report == recovery.verify(directory, workers=1)


def test_damage_is_named_and_the_recoverable_steps_shrink(tmp_path):
    directory = trained(tmp_path)
    batch = next(b for b in read_manifest(directory).batches if b.first == 19)
    path = os.path.join(directory, batch.file)
    with open(path, "r+b") as f:      # damage the record of step 20
        f.seek(16)
        _, _, _, _, packed, raw, _ = RECORD_HEADER.unpack(f.read(RECORD_HEADER.size))
        f.seek(16 + RECORD_HEADER.size + packed + raw + RECORD_HEADER.size + 2)
        value = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([value ^ 0xFF]))
    report = recovery.verify(directory, workers=3)
    assert not report.ok
    assert [(p.file, p.label) for p in report.problems] == [(path, "CORRUPT")]
    assert "step 20" in report.problems[0].why
    assert [(full, last) for full, _, last in report.recoverable] == [(0, 19), (6, 19), (12, 19), (18, 19)]
    assert report.newest_recoverable == 19 < report.newest_listed == STEPS


def test_a_missing_batch_file_is_named_and_resume_reaches_the_furthest_state_without_it(tmp_path, caplog):
    """A batch deleted from the newest full checkpoint's chain: resume stops at that full
    checkpoint's step and says which file is missing; one deleted from an older chain costs only
    the steps that chain alone reached. Either way the state is the uninterrupted run's."""
    reference = reference_digests(STEPS)
    for first, reach, recoverable in ((19, 18, [(0, 18), (6, 18), (12, 18), (18, 18)]),
                                      (13, STEPS, [(0, 12), (6, 12), (12, 12), (18, 23)])):
        directory = train_directory(str(tmp_path / f"gone-{first}"), STEPS)
        batch = next(b for b in read_manifest(directory).batches if b.first == first)
        path = os.path.join(directory, batch.file)
        os.remove(path)
        report = recovery.verify(directory)
        assert [(p.file, p.label) for p in report.problems] == [(path, "MISSING")], report.problems
        assert [(full, last) for full, _, last in report.recoverable] == recoverable
        assert not report.ok and report.newest_recoverable == reach   # ok: nothing wrong at all
        caplog.clear()
        with caplog.at_level("WARNING", logger="lowdiff"):
            step, digest = resumed_digest(directory)
        assert step == reach and digest == reference[reach], (first, step)
        if reach < STEPS:
            assert path in caplog.text and "missing" in caplog.text, caplog.text
