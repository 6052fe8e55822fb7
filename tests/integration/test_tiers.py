"""Storage tiers (lowdiff.tiers.policy, lowdiff.tiers.drainer, recovery.tiers), in process: the shared tier gets
every committed file and resumes exactly without the local one; retention policies keep exactly
what they say and every kept state resumes exactly; storage is bounded with cleaning and grows
without; the drainer never stalls training below the lag bound and applies backpressure above it.

Digests are compared with an uninterrupted run without lowdiff (lowdiff.cli.demo), one torch thread.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading

import pytest
import torch

import lowdiff
import recovery
from lowdiff.cli.demo import build, compressor_from, forward_backward, state_digest, train
from lowdiff.store.inventory import take_inventory
from lowdiff.tiers import drainer as drainer_module
from lowdiff.tiers.policy import KeepAll, KeepEvery, KeepLast, Tiers

STEPS = 30


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def reference() -> dict:
    return train(None, STEPS, log=lambda m: None)["digests"]


def wrapped(local, tiers, *, full_every=4, batch_steps=3):
    model, opt, sched, sampler = build()
    opt = lowdiff.wrap(opt, model, str(local), compressor=compressor_from("topk", 0.05), full_every=full_every,
                       batch_steps=batch_steps, scheduler=sched, extra_state={"sampler": sampler}, tiers=tiers)
    return model, opt, sched, sampler


def run_to(local, tiers, steps, **settings):
    """Train (resuming) to ``steps``; returns the Resumed of the start."""
    model, opt, sched, sampler = wrapped(local, tiers, **settings)
    try:
        start = recovery.resume(str(local), model, opt)
        for _ in range(start, steps):
            forward_backward(model, sampler)
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()
    return start


def resume_digest(local, shared, step=None):
    """Resume a plain optimizer (no wrapper) from the tiers; (Resumed, digest)."""
    model, opt, sched, sampler = build()
    torch.manual_seed(4242)  # the restored RNG must not depend on the RNG before resume
    start = recovery.resume(str(local), model, opt, step=step, scheduler=sched, extra_state={"sampler": sampler},
                            shared_dir=str(shared))
    return start, state_digest(model, opt, sched, sampler)


def listed(directory):
    return take_inventory(str(directory)).manifest


def checkpoint_files(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith(("full-", "diff-")))


def damage_every_full_checkpoint(directory):
    """Flip one bit of every full checkpoint's payload: none of them verifies any more."""
    for name in checkpoint_files(directory):
        if name.startswith("full-"):
            with open(directory / name, "r+b") as f:
                f.seek(4096 + 8)
                byte = f.read(1)
                f.seek(4096 + 8)
                f.write(bytes([byte[0] ^ 1]))


def test_local_tier_deleted_resumes_from_shared_exactly(tmp_path, reference):
    local, shared = tmp_path / "local", tmp_path / "shared"
    run_to(local, Tiers(str(shared)), 17)
    assert listed(shared).durable_step() == 17            # close() drained everything
    shutil.rmtree(local)
    start, digest = resume_digest(local, shared)
    assert (int(start), start.tier) == (17, "shared")
    assert digest == reference[17]
    # A replaced node trains on from the shared tier: the new local tier continues its run.
    run_to(local, Tiers(str(shared)), 25)
    assert listed(local).run == listed(shared).run
    start, digest = resume_digest(local, shared)
    assert (int(start), start.tier, digest) == (25, "local", reference[25])
    shutil.rmtree(local)
    assert resume_digest(local, shared)[1] == reference[25]


def test_newest_tier_wins_and_local_is_preferred_when_equal(tmp_path, reference, caplog):
    local, shared = tmp_path / "local", tmp_path / "shared"
    run_to(local, Tiers(str(shared)), 12)
    start, _ = resume_digest(local, shared)
    assert (int(start), start.tier) == (12, "local")
    # Damage every local full checkpoint: the shared tier reaches further, resume takes it and says so.
    damage_every_full_checkpoint(local)
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        start, digest = resume_digest(local, shared)
    assert (int(start), start.tier, digest) == (12, "shared", reference[12])
    assert any("shared tier" in r.getMessage() for r in caplog.records)


def test_only_the_chosen_tier_is_loaded_straight_into_the_live_tensors(tmp_path, reference, monkeypatch):
    """Tiers are ranked by what their manifests reach, so only the chosen tier's full checkpoint is
    read, and it is read into the caller's tensors (``into``), as without tiers. With its full
    checkpoints damaged, the local tier is tried first, fails, and the shared one is used."""
    import recovery.restore as restore_module
    local, shared = tmp_path / "local", tmp_path / "shared"
    run_to(local, Tiers(str(shared)), 12)
    loads = []
    load_full = restore_module.load_full

    def recording_load_full(path, *, into=None, check=None):
        loads.append((os.path.dirname(path), into is not None))
        return load_full(path, into=into, check=check)
    monkeypatch.setattr(restore_module, "load_full", recording_load_full)
    start, digest = resume_digest(local, shared)
    assert (int(start), start.tier, digest) == (12, "local", reference[12])
    assert loads == [(str(local), True)]
    damage_every_full_checkpoint(local)
    loads.clear()
    start, digest = resume_digest(local, shared)
    assert (int(start), start.tier, digest) == (12, "shared", reference[12])
    assert loads[-1] == (str(shared), True) and all(into for _, into in loads)
    assert {directory for directory, _ in loads} == {str(local), str(shared)}


def test_keep_every_keeps_exactly_the_policy_and_every_kept_state_resumes_exactly(tmp_path, reference):
    local, shared = tmp_path / "local", tmp_path / "shared"
    tiers = Tiers(str(shared), local=KeepLast(1), shared=KeepEvery(5, last=1))
    run_to(local, tiers, 22, full_every=4, batch_steps=3)
    manifest = listed(shared)
    # fulls at 0, 4, ..., 20; multiples of 5 -> the newest full before: 5->4, 10->8, 15->12, 20->20; last: 20
    assert sorted(f.step for f in manifest.fulls) == [4, 8, 12, 20]
    assert checkpoint_files(shared) == sorted(manifest.files())   # cleaned: nothing unlisted left behind
    empty = tmp_path / "no-local"
    for step in (5, 10, 15, 20, 22):
        start, digest = resume_digest(empty, shared, step=step)
        assert (int(start), digest) == (step, reference[step]), step
    with pytest.raises(lowdiff.NoCheckpointError):
        resume_digest(empty, shared, step=3)          # not kept by the policy
    # The local tier keeps its own policy: one full checkpoint and its chain.
    assert sorted(f.step for f in listed(local).fulls) == [20]


def storage_bytes(directory) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in checkpoint_files(directory))


@pytest.mark.parametrize("policy", [KeepLast(2), KeepAll()], ids=["cleaning", "keep-all"])
def test_storage_bounded_with_cleaning_and_growing_without(tmp_path, policy):
    local, shared = tmp_path / "local", tmp_path / "shared"
    tiers = Tiers(str(shared), local=policy, shared=policy)
    sizes = {}
    for steps in (10, 20, 30):
        run_to(local, tiers, steps, full_every=3, batch_steps=2)
        sizes[steps] = (storage_bytes(local), storage_bytes(shared), len(listed(shared).fulls))
    if isinstance(policy, KeepAll):
        assert sizes[10][1] < sizes[20][1] < sizes[30][1]
        # every full checkpoint: 0 3 6 9 | 10 13 16 19 | 20 23 26 29 (each session's base, then every 3)
        assert sorted(f.step for f in listed(shared).fulls) == [0, 3, 6, 9, 10, 13, 16, 19, 20, 23, 26, 29]
    else:
        assert {n for *_, n in sizes.values()} == {2}
        assert max(s[1] for s in sizes.values()) <= 1.2 * min(s[1] for s in sizes.values())
        assert max(s[0] for s in sizes.values()) <= 1.2 * min(s[0] for s in sizes.values())


def test_training_runs_free_below_the_lag_bound_then_backpressure(tmp_path, reference, monkeypatch, caplog):
    local, shared = tmp_path / "local", tmp_path / "shared"
    gate = threading.Event()
    copy = drainer_module.copy_file

    def slow_copy(*args, **kwargs):
        gate.wait()            # the shared tier does not move until the test says so
        return copy(*args, **kwargs)

    monkeypatch.setattr(drainer_module, "copy_file", slow_copy)
    model, opt, sched, sampler = wrapped(local, Tiers(str(shared), max_lag_steps=6), full_every=100, batch_steps=1)
    done: list = []
    errors: list = []

    def loop():
        try:
            for step in range(STEPS):
                forward_backward(model, sampler)
                opt.step()
                opt.zero_grad()
                done.append(step + 1)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    trainer = threading.Thread(target=loop)
    try:
        with caplog.at_level(logging.WARNING, logger="lowdiff"):
            trainer.start()
            waited: list = []
            for _ in range(600):  # until the trainer hits the bound (or finishes: then the test fails below)
                waited = [r for r in caplog.records if "behind" in r.getMessage()]
                if waited or not trainer.is_alive():
                    break
                trainer.join(0.1)
            assert waited, f"training was never held back; it did {len(done)} steps with the shared tier stuck"
            # Nothing reached the shared tier, yet training ran past the bound before it was held.
            assert len(done) >= 6
            trainer.join(0.5)
            assert trainer.is_alive(), "training went on with the shared tier stuck beyond the bound"
            assert len(done) < STEPS
            gate.set()
            trainer.join(120)
    finally:
        gate.set()   # a failure must not leave the drainer (and close() at exit) stuck
        trainer.join(120)
    assert not errors and done[-1] == STEPS
    stats = opt.stats()["tiers"]
    assert stats["backpressure_waits"] >= 1
    opt.close()
    assert len([r for r in caplog.records if "behind" in r.getMessage()]) == 1    # said once
    assert listed(shared).durable_step() == STEPS
    shutil.rmtree(local)
    start, digest = resume_digest(local, shared)
    assert (int(start), digest) == (STEPS, reference[STEPS])


def test_inspect_shows_both_tiers(tmp_path, capsys):
    from lowdiff.cli import main as cli

    local, shared = tmp_path / "local", tmp_path / "shared"
    run_to(local, Tiers(str(shared), shared=KeepEvery(5, last=1)), 9)
    assert cli.main(["inspect", str(local)]) == 0
    out = capsys.readouterr().out
    assert out.count("durable step   9") == 2
    assert "shared tier (local: keep-last 2; shared: keep-every 5 steps, and the last 1" in out
    assert "resume        from the local tier, step 9" in out


def test_shared_tier_of_another_run_is_refused(tmp_path):
    run_to(tmp_path / "a", None, 3)
    run_to(tmp_path / "b", None, 3)
    with pytest.raises(lowdiff.CheckpointError, match="another training run"):
        wrapped(tmp_path / "a", Tiers(str(tmp_path / "b")))


def test_a_copy_that_reads_back_differently_is_never_committed_and_names_the_file(tmp_path, reference, monkeypatch):
    """The drainer reads each copy back before its rename: a byte changed on the shared tier's
    device between write and rename (done here to the real temporary file) is an error naming the
    file, and nothing of that copy is listed or left in the shared tier."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    check = drainer_module.check_copy
    damaged: list = []

    def damage_then_check(path, target, nbytes, crc, engine=None):
        if not damaged and os.path.basename(target).startswith("diff-"):
            with open(path, "r+b") as f:
                f.seek(nbytes // 2)
                byte = f.read(1)
                f.seek(nbytes // 2)
                f.write(bytes([byte[0] ^ 0x10]))
            damaged.append(os.path.basename(target))
        return check(path, target, nbytes, crc, engine)

    monkeypatch.setattr(drainer_module, "check_copy", damage_then_check)
    model, opt, sched, sampler = wrapped(local, Tiers(str(shared)))
    errors: list = []
    try:
        for _ in range(12):
            forward_backward(model, sampler)
            opt.step()
            opt.zero_grad()
    except lowdiff.CorruptCheckpointError as exc:
        errors.append(exc)
    try:
        opt.close()
    except lowdiff.CorruptCheckpointError as exc:
        errors.append(exc)
    assert damaged and errors, "the damaged copy went unnoticed"
    assert all(damaged[0] in str(e) and "reads back" in str(e) for e in errors)
    assert damaged[0] not in os.listdir(shared) and damaged[0] not in listed(shared).files()
    assert not [n for n in os.listdir(shared) if ".tmp-" in n]
    assert damaged[0] in listed(local).files()          # still pinned locally: never copied
    start, digest = resume_digest(local, shared)
    assert start.tier == "local" and digest == reference[int(start)]


def test_copies_are_not_read_back_with_verify_copies_false(tmp_path, reference, monkeypatch):
    """verify_copies=False: the drainer never reads a copy back (no traffic of it on the shared
    tier; its stats say so) and the shared tier alone still resumes exactly."""
    local, shared = tmp_path / "local", tmp_path / "shared"

    def never(*args, **kwargs):
        raise AssertionError("a copy was read back with verify_copies=False")

    monkeypatch.setattr(drainer_module, "check_copy", never)
    model, opt, sched, sampler = wrapped(local, Tiers(str(shared), verify_copies=False))
    try:
        for _ in range(12):
            forward_backward(model, sampler)
            opt.step()
            opt.zero_grad()
    finally:
        opt.close()
    drained = opt.stats()["tiers"]
    assert drained["drained_files"] > 0 and drained["verify_s"] == 0.0 and drained["copy_s"] > 0
    shutil.rmtree(local)
    start, digest = resume_digest(local, shared)
    assert start.tier == "shared" and int(start) == 12 and digest == reference[12]
    with pytest.raises(TypeError, match="verify_copies"):
        Tiers(str(shared), verify_copies=1)


def test_a_dead_writers_tiers_marker_temporary_is_removed_at_open(tmp_path):
    import subprocess
    import sys

    local = tmp_path / "local"
    local.mkdir()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stray = local / f".TIERS.json.tmp-{int(gone.stdout)}-0123abcd"
    live = local / f".TIERS.json.tmp-{os.getpid()}-0123abcd"    # a live writer's: left alone
    stray.write_bytes(b'{"version": 1, "shar')
    live.write_bytes(b"")
    run_to(local, Tiers(str(tmp_path / "shared")), 2)
    assert not stray.exists() and live.exists()
    assert (local / "TIERS.json").exists()


@pytest.mark.parametrize("manifest", ["missing", "stale"])
def test_local_tier_with_only_batches_left_defers_to_its_own_shared_tier(tmp_path, reference, manifest):
    """Issue #33, 2: the local tier lost its full checkpoints (only differential batches left) and
    its manifest is missing or stale: every restart failed with 'the shared tier belongs to another
    training run' although the shared tier is the same run and reaches the newest step. The run is
    read from every file that carries it (batches too), and the restart continues exactly."""
    local, shared = tmp_path / "local", tmp_path / "shared"
    tiers = Tiers(str(shared), shared=KeepAll())
    run_to(local, tiers, 8)
    shutil.copy(local / "MANIFEST.json", tmp_path / "stale.json")   # lists files retired by step 20
    run_to(local, tiers, 20)
    for name in checkpoint_files(local):
        if name.startswith("full-"):
            os.unlink(local / name)
    if manifest == "missing":
        os.unlink(local / "MANIFEST.json")
    else:
        shutil.copy(tmp_path / "stale.json", local / "MANIFEST.json")
    assert any(n.startswith("diff-") for n in checkpoint_files(local))
    start = run_to(local, tiers, STEPS)
    assert int(start) == 20 and start.tier == "shared"
    got, digest = resume_digest(local, shared)
    assert int(got) == STEPS and digest == reference[STEPS]
