"""Damaged checkpoint directories: every truncation and bit flip of a full checkpoint, a
differential batch or the manifest is detected by ``verify``, and ``recovery.resume`` falls back to
the newest state that verifies, says so, and restores that state bit for bit. Also: foreign files,
wrong versions, the directory lock, resume/export edge cases.

One short training run (in this process) provides a pristine directory and the exact state after
every step; each test damages a copy of it.
"""
from __future__ import annotations

import copy
import dataclasses
import errno
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from lowdiff_helpers import build, forward_backward, resumed_digest, train_steps, wrap

import fastio
import lowdiff
import recovery
from lowdiff.cli import main as cli
from lowdiff.cli.demo import state_digest
from lowdiff.format import container, payloadread
from lowdiff.format.batchfile import BatchReader
from lowdiff.format.fullckpt import load_full, read_full_index
from lowdiff.format.records import RECORD_HEADER
from lowdiff.store.manifest import MANIFEST_NAME, read_manifest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 23      # with lowdiff_helpers' settings: fulls 0, 6, 12, 18; batches 1-3, ..., 19-21, 22-23


@dataclasses.dataclass
class Run:
    directory: str
    digests: dict      # step -> digest of the whole training state after that step
    states: dict       # step -> {"model", "optimizer", "scheduler", "sampler", "rng"} after that step


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    directory = str(tmp_path_factory.mktemp("pristine") / "ckpt")
    model, opt, sched, sampler = build()
    opt = wrap(directory, model, opt, sched, sampler)
    assert recovery.resume(directory, model, opt) == 0
    digests, states = {}, {}

    def snapshot(step):
        digests[step] = state_digest(model, opt, sched, sampler)
        states[step] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                        "optimizer": copy.deepcopy(opt.state_dict()), "scheduler": sched.state_dict(),
                        "sampler": sampler.state_dict(), "rng": torch.get_rng_state()}

    snapshot(0)
    train_steps(model, opt, sched, sampler, 0, STEPS, snapshot)
    opt.close()
    manifest = read_manifest(directory)
    assert sorted(f.step for f in manifest.fulls) == [0, 6, 12, 18]
    assert [(b.first, b.last) for b in manifest.batches][-2:] == [(19, 21), (22, 23)]
    assert manifest.durable_step() == STEPS
    return Run(directory, digests, states)


@pytest.fixture
def ckpt(run, tmp_path) -> str:
    directory = str(tmp_path / "ckpt")
    shutil.copytree(run.directory, directory)
    return directory


def verify(directory, capsys) -> tuple[int, list]:
    capsys.readouterr()
    status = cli.main(["verify", directory])
    return status, capsys.readouterr().out.splitlines()


def files(directory):
    manifest = read_manifest(directory)
    fulls = {f.step: os.path.join(directory, f.file) for f in manifest.fulls}
    batches = {(b.first, b.last): os.path.join(directory, b.file) for b in manifest.batches}
    return fulls, batches


# ------------------------------------------------------------------ the byte layout, independently
def trailer_ranges(path: str) -> list:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        f.seek(size - container.TRAILER.size)
        index_offset, index_len, *_ = container.TRAILER.unpack(f.read())
    return [(0, 12), (index_offset, index_offset + index_len), (size - container.TRAILER.size, size)]


def full_covered(path: str) -> list:
    """Byte ranges of a full checkpoint that hold data (preamble fields, tensors, objects, index,
    trailer); the rest is alignment padding."""
    index = read_full_index(path)
    return trailer_ranges(path) + [(t.offset, t.offset + t.nbytes) for t in index.tensors] + \
        [(index.objects.offset, index.objects.offset + index.objects.nbytes)]


def batch_records(path: str) -> list:
    with BatchReader(path) as reader:
        assert reader.index_error is None
        return list(reader.entries)


def batch_covered(path: str) -> list:
    """Ranges of a batch file that are checked: preamble fields, records (except their reserved
    flags field), index and trailer."""
    ranges = trailer_ranges(path)
    for _, offset, nbytes in batch_records(path):
        ranges += [(offset, offset + 6), (offset + 8, offset + nbytes)]
    return ranges


def inside(offset: int, ranges: list) -> bool:
    return any(a <= offset < b for a, b in ranges)


def pick_offsets(rng, size: int, covered: list, count: int) -> list:
    """Half uniformly over the file, half inside the covered ranges, plus the edges."""
    covered_offsets = np.concatenate([np.arange(a, b) for a, b in covered])
    picks = {0, size - 1}
    picks.update(int(x) for x in rng.integers(0, size, count // 2))
    picks.update(int(x) for x in rng.choice(covered_offsets, count - count // 2))
    return sorted(picks)


def expected_after_batch_damage(path: str, newest_chain: bool, truncate_at=None, flipped=None) -> int:
    """The newest step that verifies after damaging the batch file ``path`` (pristine layout)."""
    if not newest_chain:
        return STEPS
    records = batch_records(path)
    first = records[0][0]
    if truncate_at is not None:
        intact = [r for r in records if r[1] + r[2] <= truncate_at]
        return STEPS if len(intact) == len(records) else first - 1 + len(intact)
    if flipped < 10:                 # magic or version: not a (readable) lowdiff file at all
        return first - 1
    for position, (_, offset, nbytes) in enumerate(records):
        if offset <= flipped < offset + nbytes and not offset + 6 <= flipped < offset + 8:
            return first - 1 + position
    return STEPS                      # index or trailer: records are found by scanning


def damage(path: str, mode: str, offset: int, bit: int = 0) -> None:
    if mode == "truncate":
        os.truncate(path, offset)
    else:
        with open(path, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)[0]
            f.seek(offset)
            f.write(bytes([byte ^ (1 << bit)]))


def check_resume(run, directory, expected_step, caplog, warns_about=None):
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        step, digest = resumed_digest(directory)
    assert step == expected_step
    assert digest == run.digests[step], f"resumed state at step {step} differs from the uninterrupted run"
    if warns_about is not None:
        messages = [r.getMessage() for r in caplog.records if r.name == "lowdiff" and r.levelno >= logging.WARNING]
        assert any(warns_about in m for m in messages), f"no warning naming {warns_about}: {messages}"


# ------------------------------------------------------------------ the pristine directory
def test_pristine_directory_verifies_and_resumes_exactly(run, ckpt, capsys, caplog):
    status, lines = verify(ckpt, capsys)
    assert status == 0, lines
    assert lines[-1] == "12 files verify, 0 do not"
    check_resume(run, ckpt, STEPS, caplog)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------------ damage, file kind by file kind
CASES = [("full", 18, True), ("full", 6, False), ("batch", (19, 21), True), ("batch", (22, 23), True),
         ("batch", (7, 9), False)]


@pytest.mark.parametrize("mode", ["truncate", "flip"])
@pytest.mark.parametrize("kind,which,newest", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_damage_is_detected_and_resume_falls_back(run, tmp_path, capsys, caplog, rng, mode, kind, which, newest):
    fulls, batches = files(run.directory)
    pristine = fulls[which] if kind == "full" else batches[which]
    name = os.path.basename(pristine)
    size = os.path.getsize(pristine)
    covered = full_covered(pristine) if kind == "full" else batch_covered(pristine)
    offsets = pick_offsets(rng, size, covered, 8)
    if mode == "truncate":
        offsets = sorted(set(offsets) | {1, 15, 16, size - container.TRAILER.size})
    for n, offset in enumerate(offsets):
        directory = str(tmp_path / f"c{n}")
        shutil.copytree(run.directory, directory)
        path = os.path.join(directory, name)
        bit = int(rng.integers(0, 8))
        damage(path, mode, offset, bit)
        detectable = mode == "truncate" or inside(offset, covered)
        where = f"{mode} {name} at offset {offset} (bit {bit})"

        status, lines = verify(directory, capsys)
        if detectable:
            assert status == 1, f"{where}: verify did not notice: {lines}"
            assert any(line.startswith("CORRUPT") and name in line for line in lines), f"{where}: {lines}"
            assert sum(line.startswith("CORRUPT") for line in lines) == 1, lines

        if kind == "full":
            # every kept full checkpoint still reaches the last step through the batches
            expected, warns = STEPS, (name if newest and detectable else None)
        else:
            expected = expected_after_batch_damage(pristine, newest and detectable,
                                                   truncate_at=offset if mode == "truncate" else None,
                                                   flipped=offset if mode == "flip" else None)
            warns = name if newest and detectable else None
        try:
            check_resume(run, directory, expected, caplog, warns)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        shutil.rmtree(directory)


@pytest.mark.parametrize("mode", ["truncate", "flip"])
def test_damaged_manifest_is_detected_and_rebuilt(run, tmp_path, capsys, caplog, rng, mode):
    size = os.path.getsize(os.path.join(run.directory, MANIFEST_NAME))
    for n, offset in enumerate(pick_offsets(rng, size, [(0, size)], 8)):
        directory = str(tmp_path / f"c{n}")
        shutil.copytree(run.directory, directory)
        damage(os.path.join(directory, MANIFEST_NAME), mode, offset, int(rng.integers(0, 8)))
        status, lines = verify(directory, capsys)
        assert status == 1, f"{mode} at {offset}: verify did not notice the damaged manifest: {lines}"
        assert any(line.startswith("CORRUPT") and MANIFEST_NAME in line for line in lines), lines
        check_resume(run, directory, STEPS, caplog, warns_about=MANIFEST_NAME)
        shutil.rmtree(directory)


def test_missing_manifest_is_rebuilt(run, ckpt, caplog):
    os.unlink(os.path.join(ckpt, MANIFEST_NAME))
    check_resume(run, ckpt, STEPS, caplog, warns_about=MANIFEST_NAME)


def test_verify_command_line(run, ckpt):
    """The real ``python -m lowdiff verify`` process: exit status and the file it names."""
    fulls, batches = files(ckpt)
    damage(batches[(10, 12)], "flip", batch_records(batches[(10, 12)])[1][1] + 40)
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "lowdiff", "verify", ckpt], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    corrupt = [line for line in proc.stdout.splitlines() if line.startswith("CORRUPT")]
    assert len(corrupt) == 1 and os.path.basename(batches[(10, 12)]) in corrupt[0] and "step 11" in corrupt[0]


def test_continuing_after_a_fallback_is_exact(run, ckpt, caplog):
    """Damage record 20; resume lands on 19, training on reproduces the uninterrupted run."""
    _, batches = files(ckpt)
    damage(batches[(19, 21)], "flip", batch_records(batches[(19, 21)])[1][1] + RECORD_HEADER.size + 3)
    model, opt, sched, sampler = build()
    opt = wrap(ckpt, model, opt, sched, sampler)
    try:
        with caplog.at_level(logging.WARNING, logger="lowdiff"):
            start = recovery.resume(ckpt, model, opt)
        assert start == 19
        assert state_digest(model, opt, sched, sampler) == run.digests[19]
        seen = {}
        train_steps(model, opt, sched, sampler, start, STEPS,
                    lambda step: seen.setdefault(step, state_digest(model, opt, sched, sampler)))
        assert seen == {s: run.digests[s] for s in range(20, STEPS + 1)}
    finally:
        opt.close()
    step, digest = resumed_digest(ckpt)
    assert (step, digest) == (STEPS, run.digests[STEPS])
    assert not os.path.exists(batches[(19, 21)]), "the abandoned timeline must be dropped"


def test_nothing_verifies(ckpt):
    fulls, _ = files(ckpt)
    for path in fulls.values():
        damage(path, "flip", os.path.getsize(path) - 1)
    with pytest.raises(lowdiff.NoCheckpointError, match="no full checkpoint verifies"):
        resumed_digest(ckpt)


# ------------------------------------------------------------------ foreign files, versions
def test_foreign_file_under_a_checkpoint_name(run, ckpt, rng, capsys, caplog):
    fulls, batches = files(ckpt)
    for path in (fulls[18], batches[(19, 21)]):
        size = os.path.getsize(path)
        with open(path, "wb") as f:
            f.write(rng.bytes(size))
    with pytest.raises(lowdiff.ForeignFileError, match="not a lowdiff file") as info:
        load_full(fulls[18])
    assert info.value.path == fulls[18] and fulls[18] in str(info.value)
    with pytest.raises(lowdiff.ForeignFileError) as info:
        BatchReader(batches[(19, 21)])
    assert info.value.path == batches[(19, 21)]
    status, lines = verify(ckpt, capsys)
    assert status == 1
    corrupt = [line for line in lines if line.startswith("CORRUPT")]
    assert len(corrupt) == 2 and all("not a lowdiff file" in line for line in corrupt)
    check_resume(run, ckpt, 18, caplog, warns_about=os.path.basename(batches[(19, 21)]))

    manifest = os.path.join(ckpt, MANIFEST_NAME)
    with open(manifest, "wb") as f:
        f.write(rng.bytes(os.path.getsize(manifest)))
    with pytest.raises(lowdiff.CorruptCheckpointError, match="manifest is not valid") as info:
        read_manifest(ckpt)
    assert info.value.path == manifest
    check_resume(run, ckpt, 18, caplog, warns_about=MANIFEST_NAME)


def test_a_batch_whose_scan_fails_leaves_no_descriptor_open(ckpt, monkeypatch):
    """A torn batch's records are found by scanning; an I/O error during that scan raised from
    BatchReader's constructor with its file still open (closed only by the garbage collector)."""
    _, batches = files(ckpt)
    path = batches[(22, 23)]
    damage(path, "truncate", os.path.getsize(path) - 1)   # a torn trailer: the index is not used

    def failing_scan(self):
        raise OSError(errno.EIO, "injected read error", path)
    monkeypatch.setattr(BatchReader, "_scan", failing_scan)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(OSError, match="injected read error"):
        BatchReader(path)
    assert set(os.listdir("/proc/self/fd")) <= before   # closed now, not by the garbage collector


def _loader_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith("lowdiff-load-")]


def test_full_load_in_many_chunks_equals_one_chunk_and_stops_at_a_bad_tensor(ckpt, monkeypatch):
    """load_full populates each chunk of new memory in a helper thread that then queues its read;
    with chunks of one page (dozens of them here) the state is the same as read in one chunk, and
    a tensor failing its checksum stops the load with the helper joined and the file closed."""
    fulls, _ = files(ckpt)
    path = fulls[18]
    _, whole = load_full(path)
    monkeypatch.setattr(payloadread, "LOAD_CHUNK_BYTES", 4096)
    index, paged = load_full(path)
    assert index.payload_bytes > 8 * 4096
    for key, tensor in whole.model.items():
        assert torch.equal(paged.model[key], tensor), key
    assert str(paged.optimizer) == str(whole.optimizer)

    entry = max(index.tensors, key=lambda e: e.offset)   # in the last chunks: the helper ran ahead
    damage(path, "flip", entry.offset + entry.nbytes // 2)
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(lowdiff.CorruptCheckpointError, match="fails its checksum") as info:
        load_full(path)
    assert info.value.path == path and entry.key in str(info.value)
    assert not _loader_threads()
    assert set(os.listdir("/proc/self/fd")) <= before


def test_full_load_into_live_tensors(ckpt, monkeypatch):
    """``into``: model tensors are read straight into the caller's tensors (through the ring of
    chunks when a chunk holds only theirs: one-page chunks make most chunks so), the state holds
    those very tensors, bytes equal to the ordinary load; a tensor of the wrong shape is left alone."""
    fulls, _ = files(ckpt)
    path = fulls[18]
    _, expected = load_full(path)
    model, _, _, _ = build()
    live = {f"/model/{k}": v for k, v in model.state_dict(keep_vars=True).items()}
    odd_key = next(k for k, v in live.items() if v.dim() == 2)
    live[odd_key] = torch.zeros(3, 3)
    monkeypatch.setattr(payloadread, "LOAD_CHUNK_BYTES", 4096)
    monkeypatch.setattr(payloadread, "RING_CHUNKS", 2)
    _, state = load_full(path, into=live)
    for key, tensor in expected.model.items():
        assert torch.equal(state.model[key], tensor), key
        if f"/model/{key}" != odd_key:
            assert state.model[key] is live[f"/model/{key}"], key
    assert not live[odd_key].any() and state.model[odd_key[len("/model/"):]] is not live[odd_key]
    assert str(state.optimizer) == str(expected.optimizer)


@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_a_bad_model_tensor_read_in_place_falls_back_exactly(run, ckpt, caplog, monkeypatch, chunk):
    """resume reads the full checkpoint's model tensors into the model it is given: a damaged one
    in the newest full checkpoint leaves that model holding part of it, and the fallback to the
    older full checkpoint overwrites every one of them: the state is still exact."""
    fulls, _ = files(ckpt)
    index = read_full_index(fulls[18])
    entry = max((e for e in index.tensors if e.key.startswith("/model/")), key=lambda e: e.offset)
    damage(fulls[18], "flip", entry.offset + entry.nbytes - 1)
    monkeypatch.setattr(payloadread, "LOAD_CHUNK_BYTES", chunk)
    check_resume(run, ckpt, STEPS, caplog, warns_about=entry.key)
    assert not _loader_threads()


def resume_into_stepped(directory):
    """Resume into objects whose optimizer already has state (a stepped one, as when going back in
    a process that trained): (step, digest, {state key: data_ptr} before and after)."""
    model, opt, sched, sampler = build()
    forward_backward(model, sampler)
    opt.step()
    opt.zero_grad()

    def pointers():
        return {(i, k): v.data_ptr() for i, s in opt.state_dict()["state"].items() for k, v in s.items()
                if isinstance(v, torch.Tensor) and v.numel() > 1}
    before = pointers()
    step = recovery.resume(directory, model, opt, scheduler=sched, extra_state={"sampler": sampler})
    return step, state_digest(model, opt, sched, sampler), before, pointers()


def test_optimizer_state_is_read_in_place_when_the_optimizer_has_some(run, ckpt, caplog):
    """An optimizer that already has state gets the full checkpoint's state read straight into its
    tensors (no new memory: the optimizer keeps the very tensors), and the result is exact."""
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        step, digest, before, after = resume_into_stepped(ckpt)
    assert step == STEPS and digest == run.digests[STEPS]
    assert before and after == before
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_a_bad_optimizer_tensor_read_in_place_falls_back_exactly(run, ckpt, caplog, monkeypatch, chunk):
    """A damaged optimizer state tensor in the newest full checkpoint, read into the live optimizer's
    tensors: the fallback to the older full checkpoint restores the state exactly."""
    fulls, _ = files(ckpt)
    index = read_full_index(fulls[18])
    entry = max((e for e in index.tensors if e.key.startswith("/optimizer/state/")), key=lambda e: e.offset)
    damage(fulls[18], "flip", entry.offset + entry.nbytes - 1)
    monkeypatch.setattr(payloadread, "LOAD_CHUNK_BYTES", chunk)
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        step, digest, _, _ = resume_into_stepped(ckpt)
    assert step == STEPS and digest == run.digests[STEPS]
    assert any(entry.key in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)
    assert not _loader_threads()


def test_live_tensors_sharing_memory_only_partly_are_not_read_in_place():
    """Two targets overlapping in part cannot both take their bytes in place (the later write would
    undo part of the earlier): the one starting first is kept, the other loads into new memory.
    The same memory under two keys (tied weights) is kept under both."""
    base = torch.zeros(64)
    tied = torch.zeros(16)
    placed = {"a": base[:32], "b": base[16:48], "c": base[48:], "t1": tied, "t2": tied}
    assert list(payloadread.apart(placed)) == ["a", "c", "t1", "t2"]


def test_full_load_without_madvise_populate(ckpt, monkeypatch):
    """Kernels before 5.14 have no MADV_POPULATE_WRITE (and a libc may lack madvise): populate says
    so, and the load takes its page faults in the reads instead, with the same result."""
    fulls, _ = files(ckpt)
    _, expected = load_full(fulls[18])
    monkeypatch.setattr(fastio._memory, "_madvise", [None])
    buffer = fastio.aligned_buffer(3 * 4096)
    assert buffer.populate() is False
    monkeypatch.setattr(payloadread, "LOAD_CHUNK_BYTES", 4096)
    _, state = load_full(fulls[18])
    for key, tensor in expected.model.items():
        assert torch.equal(state.model[key], tensor), key


def test_wrong_version(run, ckpt, capsys, caplog, tmp_path):
    """Files a newer lowdiff wrote are never damage: resume raises VersionMismatchError naming the
    file and both versions, nothing deletes them, and an older step can still be exported."""
    fulls, batches = files(ckpt)
    for path in (fulls[18], batches[(22, 23)]):
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<H", 2))
    with pytest.raises(lowdiff.VersionMismatchError, match="version 2") as info:
        load_full(fulls[18])
    assert info.value.path == fulls[18]
    with pytest.raises(lowdiff.VersionMismatchError) as info:
        BatchReader(batches[(22, 23)])
    assert info.value.path == batches[(22, 23)]
    status, lines = verify(ckpt, capsys)
    assert status == 1 and sum(line.startswith("VERSION") and "version 2" in line for line in lines) == 2, lines
    before = sorted(os.listdir(ckpt))
    with pytest.raises(lowdiff.VersionMismatchError, match=r"version 2, this lowdiff reads version 1") as info:
        resumed_digest(ckpt)
    assert info.value.path == fulls[18]
    model, opt, sched, sampler = build()
    with pytest.raises(lowdiff.VersionMismatchError):
        wrap(ckpt, model, opt, sched, sampler)   # refused before the trainer touches anything
    assert sorted(os.listdir(ckpt)) == before, "files of another version must never be deleted"
    out = str(tmp_path / "older.pt")
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        assert recovery.export(ckpt, out, step=12) == 12   # an older state, explicitly asked for
    assert torch.equal(torch.load(out, weights_only=True)["model"]["0.weight"], run.states[12]["model"]["0.weight"])
    assert sorted(os.listdir(ckpt)) == before


def test_manifest_of_another_version(run, ckpt, caplog):
    """A manifest a newer lowdiff wrote is refused by every entry point and never rewritten."""
    path = os.path.join(ckpt, MANIFEST_NAME)
    outer = json.loads(Path(path).read_bytes())
    outer["manifest"]["version"] = 2
    outer["crc32"] = zlib.crc32(json.dumps(outer["manifest"], indent=1, sort_keys=True).encode())
    with open(path, "w") as f:
        json.dump(outer, f)
    before = {name: Path(ckpt, name).read_bytes() for name in os.listdir(ckpt)}
    with pytest.raises(lowdiff.VersionMismatchError, match="manifest version 2, this lowdiff reads version 1") as info:
        read_manifest(ckpt)
    assert info.value.path == path
    with pytest.raises(lowdiff.VersionMismatchError):
        resumed_digest(ckpt)
    model, opt, sched, sampler = build()
    with pytest.raises(lowdiff.VersionMismatchError):
        wrap(ckpt, model, opt, sched, sampler)
    assert cli.main(["verify", ckpt]) == 2
    after = {name: Path(ckpt, name).read_bytes() for name in os.listdir(ckpt) if name != "LOCK"}
    before.pop("LOCK", None)
    assert after == before


def test_batch_file_named_after_another_kind(ckpt):
    fulls, batches = files(ckpt)
    shutil.copyfile(batches[(7, 9)], fulls[6])
    with pytest.raises(lowdiff.CorruptCheckpointError, match="expected a full checkpoint") as info:
        load_full(fulls[6])
    assert info.value.path == fulls[6]


# ------------------------------------------------------------------ misuse and edge cases
def test_two_trainers_on_one_directory(tmp_path):
    directory = str(tmp_path / "ckpt")
    model, opt, sched, sampler = build()
    first = wrap(directory, model, opt, sched, sampler)
    try:
        model2, opt2, sched2, sampler2 = build()
        with pytest.raises(lowdiff.CheckpointLockedError, match="another trainer"):
            wrap(directory, model2, opt2, sched2, sampler2)
    finally:
        first.close()
    model2, opt2, sched2, sampler2 = build()
    wrap(directory, model2, opt2, sched2, sampler2).close()  # the lock is released by close()


def test_wrap_without_resume_refuses_to_train_over_checkpoints(ckpt):
    before = {name: Path(ckpt, name).read_bytes() for name in os.listdir(ckpt) if name != "LOCK"}
    model, opt, sched, sampler = build()
    opt = wrap(ckpt, model, opt, sched, sampler)
    try:
        model(torch.randn(4, 32)).sum().backward()
        with pytest.raises(lowdiff.CheckpointError, match="recovery.resume"):
            opt.step()
    finally:
        opt.close()
    after = {name: Path(ckpt, name).read_bytes() for name in os.listdir(ckpt) if name != "LOCK"}
    assert after == before, "a refused step must not change the directory"


@pytest.mark.parametrize("wrapped", [True, False])
def test_resume_of_a_missing_or_empty_directory_returns_zero(tmp_path, wrapped):
    for directory in (str(tmp_path / "missing"), str(tmp_path / "empty")):
        if directory.endswith("empty"):
            os.makedirs(directory)
        model, opt, sched, sampler = build()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        if wrapped:
            if directory.endswith("missing"):
                continue  # wrap creates the directory; covered by "empty"
            opt = wrap(directory, model, opt, sched, sampler)
        try:
            assert recovery.resume(directory, model, opt, scheduler=sched, extra_state={"sampler": sampler}) == 0
        finally:
            if wrapped:
                opt.close()
        assert all(torch.equal(initial[k], v) for k, v in model.state_dict().items())
        assert sampler.state_dict() == {"epoch": 0, "position": 0}


@pytest.mark.parametrize("step", [0, 12, 17, 20, STEPS, None])
def test_export_of_a_step_equals_the_state_at_that_step(run, tmp_path, step):
    out = str(tmp_path / "out.pt")
    if step == 20:  # through the command line
        assert cli.main(["export", run.directory, "--step", "20", "-o", out]) == 0
    else:
        assert recovery.export(run.directory, out, step=step) == (STEPS if step is None else step)
    step = STEPS if step is None else step
    exported = torch.load(out, weights_only=True)
    want = run.states[step]
    assert exported["step"] == step
    assert set(exported["model"]) == set(want["model"])
    for key, tensor in want["model"].items():
        assert torch.equal(exported["model"][key], tensor), f"model[{key!r}] at step {step}"
        assert exported["model"][key].dtype == tensor.dtype
    opt_state = exported["optimizer"]["state"]
    assert set(opt_state) == set(want["optimizer"]["state"])
    for index, entry in want["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(opt_state[index][key]), torch.as_tensor(value)), \
                f"optimizer {index}/{key}"
    assert exported["optimizer"]["param_groups"][0]["lr"] == want["optimizer"]["param_groups"][0]["lr"]
    assert exported["scheduler"] == want["scheduler"]
    assert exported["extra"] == {"sampler": want["sampler"]}
    assert torch.equal(exported["rng"]["torch"], want["rng"])


def test_export_of_a_step_that_is_gone(run, tmp_path):
    out = str(tmp_path / "out.pt")
    with pytest.raises(lowdiff.NoCheckpointError):
        recovery.export(run.directory, out, step=STEPS + 5)
    assert not os.path.exists(out)
