"""Store safety, as a hostile user would test it: stale and foreign manifests never make lowdiff
delete or forget valid files; a file is what the manifest says it is; checkpoints loaded into the
wrong objects are refused before anything changes; background write errors are sticky and honest;
readers beside a live trainer see a consistent state; every wrong input gets a clear error.
"""
from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from lowdiff_helpers import build, reference_digests, resumed_digest, train_steps, wrap

import lowdiff
import recovery
from lowdiff.cli import main as cli
from lowdiff.cli.demo import state_digest
from lowdiff.store.manifest import MANIFEST_NAME, read_manifest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def checkpoint_files(directory) -> set:
    return {n for n in os.listdir(directory) if n.endswith((".ldf", ".ldd"))}


def train(directory, start, stop, digests=None, **options):
    """Resume ``directory`` and train to ``stop``; returns the step resume landed on."""
    model, opt, sched, sampler = build()
    opt = wrap(directory, model, opt, sched, sampler, **options)
    try:
        resumed = recovery.resume(directory, model, opt)
        assert resumed == start, f"resumed at {resumed}, expected {start}"
        record = None if digests is None else \
            (lambda s: digests.__setitem__(s, state_digest(model, opt, sched, sampler)))
        train_steps(model, opt, sched, sampler, resumed, stop, record)
    finally:
        opt.close()
    return resumed


@pytest.fixture(scope="module")
def reference():
    """Digests of the uninterrupted run without lowdiff (same compression), step by step."""
    return reference_digests(40)


# ------------------------------------------------------------------ 1. stale and foreign manifests
@pytest.mark.parametrize("keep_full", [2, 4])
def test_a_stale_manifest_never_deletes_newer_files(tmp_path, reference, caplog, capsys, keep_full):
    """Train to 20, keep the manifest, resume and train to 37, put the step-20 manifest back (a
    restore from a backup): nothing is deleted, verify passes, resume lands on 37 exactly."""
    ckpt = str(tmp_path / "ckpt")
    train(ckpt, 0, 20, retention=lowdiff.KeepLast(keep_full))
    stale = Path(ckpt, MANIFEST_NAME).read_bytes()
    train(ckpt, 20, 37, retention=lowdiff.KeepLast(keep_full))
    files_at_37 = checkpoint_files(ckpt)
    with open(os.path.join(ckpt, MANIFEST_NAME), "wb") as f:
        f.write(stale)

    assert cli.main(["verify", ckpt]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "adopted" in out
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        assert resumed_digest(ckpt) == (37, reference[37])
    assert any(MANIFEST_NAME in r.getMessage() for r in caplog.records), "say that the manifest was stale"
    assert checkpoint_files(ckpt) == files_at_37

    model, opt, sched, sampler = build()
    opt = wrap(ckpt, model, opt, sched, sampler, retention=lowdiff.KeepLast(keep_full))
    try:
        assert recovery.resume(ckpt, model, opt) == 37
        assert state_digest(model, opt, sched, sampler) == reference[37]
        assert checkpoint_files(ckpt) == files_at_37, "wrap() must not delete files the manifest did not explain"
        assert read_manifest(ckpt).files() == files_at_37, "the trainer commits the reconciled list"
        train_steps(model, opt, sched, sampler, 37, 39)
    finally:
        opt.close()
    assert resumed_digest(ckpt) == (39, reference[39])


def test_another_runs_manifest_is_replaced_by_the_files(tmp_path, reference, caplog):
    ckpt, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    train(ckpt, 0, 14)
    train(other, 0, 5)
    files = checkpoint_files(ckpt)
    shutil.copyfile(os.path.join(other, MANIFEST_NAME), os.path.join(ckpt, MANIFEST_NAME))
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        assert resumed_digest(ckpt) == (14, reference[14])
    assert any("lists none of" in r.getMessage() for r in caplog.records)
    train(ckpt, 14, 16)
    assert files - checkpoint_files(ckpt) <= {r.file for r in read_manifest(ckpt).retired} | files
    assert resumed_digest(ckpt) == (16, reference[16])


def test_a_foreign_file_under_its_own_name_is_never_used_nor_deleted(tmp_path, reference, caplog, capsys):
    """A newer full checkpoint of another run dropped into the directory would be the 'newest'."""
    ckpt, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    train(ckpt, 0, 14)
    train(other, 0, 20)
    foreign = sorted(n for n in checkpoint_files(other) if n.startswith("full-"))[-1]
    shutil.copyfile(os.path.join(other, foreign), os.path.join(ckpt, foreign))
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        assert resumed_digest(ckpt) == (14, reference[14])
    assert any(foreign in r.getMessage() and "run" in r.getMessage() for r in caplog.records)
    assert cli.main(["verify", ckpt]) == 1
    assert any(line.startswith("FOREIGN") and foreign in line for line in capsys.readouterr().out.splitlines())
    train(ckpt, 14, 16)
    assert os.path.exists(os.path.join(ckpt, foreign)), "a file of another run must never be deleted"


def test_a_manifest_that_is_not_ours_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / MANIFEST_NAME).write_text('{"name": "my dataset", "files": []}')
    model, opt, sched, sampler = build()
    with pytest.raises(lowdiff.ForeignFileError, match="not a lowdiff manifest") as info:
        wrap(str(ckpt), model, opt, sched, sampler)
    assert info.value.path == str(ckpt / MANIFEST_NAME)
    with pytest.raises(lowdiff.ForeignFileError):
        resumed_digest(str(ckpt))
    assert (ckpt / MANIFEST_NAME).read_text() == '{"name": "my dataset", "files": []}'


# ------------------------------------------------------------------ 2. a file is what the manifest says
@pytest.mark.parametrize("kind", ["full", "batch"])
def test_a_file_of_another_run_under_this_runs_name_is_damage(tmp_path, reference, caplog, capsys, kind):
    ckpt, other = str(tmp_path / "ckpt"), str(tmp_path / "other")
    train(ckpt, 0, 23)
    train(other, 0, 23)
    manifest, theirs = read_manifest(ckpt), read_manifest(other)
    if kind == "full":
        mine = max(manifest.fulls, key=lambda f: f.step)
        source = next(f for f in theirs.fulls if f.step == mine.step)
        expected = 23          # an older full checkpoint still reaches the last step
    else:
        mine = next(b for b in manifest.batches if b.first == 19)
        source = next(b for b in theirs.batches if (b.first, b.last) == (mine.first, mine.last))
        expected = 18
    shutil.copyfile(os.path.join(other, source.file), os.path.join(ckpt, mine.file))
    assert cli.main(["verify", ckpt]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("CORRUPT") and mine.file in line and "session" in line for line in lines), lines
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        assert resumed_digest(ckpt) == (expected, reference[expected])
    assert any(mine.file in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ 3. wrong objects are refused
def _models_equal(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("case", ["optimizer", "compressor", "shapes", "layout", "extra_state"])
def test_loading_into_the_wrong_objects_is_refused_before_anything_changes(tmp_path, case):
    ckpt = str(tmp_path / "ckpt")
    train(ckpt, 0, 8)
    model, opt, sched, sampler = build()
    compressor = lowdiff.TopK(ratio=0.1, min_numel=256)
    extra = {"sampler": sampler}
    if case == "optimizer":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        match = r"torch\.optim\.adamw\.AdamW.*torch\.optim\.sgd\.SGD"
    elif case == "compressor":
        compressor = lowdiff.Dense()
        match = r"TopK.*Dense"
    elif case == "shapes":
        model[4] = torch.nn.Linear(48, 11)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        match = r"4\.weight: \(10, 48\) vs \(11, 48\)"
    elif case == "layout":
        opt = torch.optim.AdamW(list(model.parameters())[:-1], lr=1e-2, weight_decay=0.01)
        match = r"param groups of \[6\] parameters.*\[5\]"
    else:
        extra = {"sampler": sampler, "other": sampler}
        match = r"extra_state \['other'\]"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng_before = torch.get_rng_state()
    opt = lowdiff.wrap(opt, model, ckpt, compressor=compressor, full_every=6, batch_steps=3, extra_state=extra,
                       scheduler=sched if sched.optimizer is opt else None)
    try:
        with pytest.raises(lowdiff.IncompatibleCheckpointError, match=match) as info:
            recovery.resume(ckpt, model, opt)
        assert "full-" in str(info.value), "the error names the file"
    finally:
        opt.close()
    assert _models_equal(before, model.state_dict()), "nothing may change before the error"
    assert torch.equal(rng_before, torch.get_rng_state())
    assert sampler.state_dict() == {"epoch": 0, "position": 0}


# ------------------------------------------------------------------ 5. errors are sticky and honest
@pytest.fixture
def tiny_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield str(mount)
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_write_error_is_sticky_and_never_looks_like_a_change_outside_step(tiny_tmpfs, tmp_path, reference):
    ckpt = os.path.join(tiny_tmpfs, "ckpt")
    model, opt, sched, sampler = build()
    opt = wrap(ckpt, model, opt, sched, sampler, full_every=1, retention=lowdiff.KeepLast(1000))
    recovery.resume(ckpt, model, opt)
    failure = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(200):
            try:
                train_steps(model, opt, sched, sampler, opt.step_count, opt.step_count + 1)
                opt.flush() if opt.step_count % 5 == 0 else None
            except OSError as exc:
                failure = exc
                break
        assert failure is not None and failure.errno == errno.ENOSPC, "the tmpfs never filled up"
        assert ckpt in str(failure) or ckpt in (failure.filename or ""), failure
        assert any("checkpointing has stopped" in note for note in getattr(failure, "__notes__", []))
        durable = opt.durable_step
        step_count = opt.step_count
        for call in (lambda: train_steps(model, opt, sched, sampler, step_count, step_count + 1), opt.flush):
            with pytest.raises(OSError) as again:
                call()
            assert again.value.errno == errno.ENOSPC
        assert opt.step_count == step_count, "a refused step changes nothing"
        with pytest.raises(OSError):
            opt.close()
        with pytest.raises(OSError):
            opt.close()   # and it keeps saying so
    assert not [w for w in caught if "outside" in str(w.message)], [str(w.message) for w in caught]
    copy = str(tmp_path / "copy")
    shutil.copytree(ckpt, copy)
    assert resumed_digest(copy) == (durable, reference[durable])


# ------------------------------------------------------------------ 6. readers, odd paths, odd files
def test_readers_beside_a_live_trainer_see_a_consistent_state(tmp_path, capsys):
    ckpt = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "lowdiff.cli.demo", "train", ckpt, "--steps", "400",
                             "--full-every", "2", "--batch-steps", "1"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=REPO)
    try:
        for line in proc.stdout:
            if line.startswith("step 10 "):
                break
        exported = []
        for n in range(12):
            assert proc.poll() is None, "the trainer ended too early for this test"
            status = cli.main(["verify", ckpt])
            out = capsys.readouterr().out
            assert status == 0 and "CORRUPT" not in out, out
            exported.append(recovery.export(ckpt, str(tmp_path / f"e{n}.pt")))
        assert exported == sorted(exported)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_paths_that_are_files_are_refused_by_name(tmp_path):
    path = tmp_path / "not-a-dir"
    path.write_text("x")
    model, opt, sched, sampler = build()
    with pytest.raises(NotADirectoryError, match="not-a-dir is a file"):
        recovery.resume(str(path), model, opt)
    with pytest.raises(NotADirectoryError, match="not-a-dir is a file"):
        wrap(str(path), model, opt, sched, sampler)
    with pytest.raises(NotADirectoryError):
        recovery.export(str(path), str(tmp_path / "out.pt"))
    assert cli.main(["verify", str(path)]) == 2


def test_verify_of_a_directory_without_a_checkpoint_fails(tmp_path, capsys):
    assert cli.main(["verify", str(tmp_path)]) == 1
    assert "holds no lowdiff checkpoint" in capsys.readouterr().out


def test_export_of_a_step_that_is_not_retained_lists_what_is(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    train(ckpt, 0, 23, retention=lowdiff.KeepLast(2))      # fulls 12 and 18 kept
    with pytest.raises(lowdiff.NoCheckpointError, match=r"step 5 is not retained; retained steps: 12\.\.23 "
                                                        r"\(full checkpoints at steps 12, 18\)"):
        recovery.export(ckpt, str(tmp_path / "out.pt"), step=5)


def test_a_bad_backend_is_refused_at_wrap(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTIO_BACKEND", "fastest")
    import fastio._select as select
    monkeypatch.setattr(select, "_engine", None)
    model, opt, sched, sampler = build()
    with pytest.raises(ValueError, match="FASTIO_BACKEND='fastest'"):
        wrap(str(tmp_path / "ckpt"), model, opt, sched, sampler)
    assert not os.path.exists(tmp_path / "ckpt")


def _wrong_wrap_calls():
    def fresh():
        model = torch.nn.Linear(4, 2)
        return model, torch.optim.AdamW(model.parameters())

    def other_optimizer_params(d):
        model, _ = fresh()
        return lowdiff.wrap(torch.optim.AdamW(torch.nn.Linear(4, 2).parameters()), model, d)

    def other_optimizer_scheduler(d):
        model, opt = fresh()
        sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=1), 3)
        return lowdiff.wrap(opt, model, d, scheduler=sched)

    return {
        "compressor": (lambda d: lowdiff.wrap(*reversed(fresh()), d, compressor="topk"), TypeError, "lowdiff.TopK"),
        "extra_state": (lambda d: lowdiff.wrap(*reversed(fresh()), d, extra_state=[1]), TypeError, "dict"),
        "scheduler": (lambda d: lowdiff.wrap(*reversed(fresh()), d, scheduler="cosine"), TypeError, "scheduler"),
        "directory": (lambda d: lowdiff.wrap(*reversed(fresh()), None), TypeError, "directory must be a path"),
        "params": (other_optimizer_params, ValueError, "not a parameter of the model"),
        "scheduler-optimizer": (other_optimizer_scheduler, ValueError, "another optimizer"),
        "resume-optimizer": (lambda d: recovery.resume(d, fresh()[0], None), TypeError, "optimizer must be"),
        "resume-model": (lambda d: recovery.resume(d, None, fresh()[1]), TypeError, "model must be"),
    }


@pytest.mark.parametrize("case", sorted(_wrong_wrap_calls()))
def test_wrong_arguments_get_errors_that_name_them(tmp_path, case):
    call, error, match = _wrong_wrap_calls()[case]
    with pytest.raises(error, match=match):
        call(str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt"), "nothing is created for a refused call"
