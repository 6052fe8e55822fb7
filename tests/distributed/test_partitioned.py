"""Partitioned directories on real gloo processes (partition_worker.py): each rank writes a share;
a rank SIGKILLed mid-run (the others taken down, as torchrun does) or mid-write of its share of a
full checkpoint; resume with 1, 2 and 3 ranks lands every rank on the state of an uninterrupted run,
byte for byte; a damaged or missing share makes resume fall back and say so; a rank's damaged or
missing manifest loses nothing (rebuilt from the share files); a torn differential share ends the
chain where it is torn; time travel to every retained step at 1 and 2 ranks; retention cleans the
directories of ranks a run resumed with fewer ranks dropped."""
import logging
import os
import subprocess
import sys

import pytest
import torch

import lowdiff
import recovery
from lowdiff.cli.main import main as cli
from lowdiff.distributed.partition import rank_directories
from lowdiff.format.sharefile import parse_diff_share
from lowdiff.store.manifest import read_manifest, write_manifest

sys.path.insert(0, os.path.dirname(__file__))
import partition_worker  # noqa: E402
from partition_runs import STEPS, checkpoint_files, copy_directory, digests, launch, ok, resumed_exactly  # noqa: E402


def test_one_rank_killed_then_resumed_with_1_2_and_3_ranks(tmp_path, reference):
    ref, _ = reference
    crashed = launch(tmp_path / "ckpt", tmp_path / "run", 2, "--crash-at", "10", "--crash-ranks", "1")
    assert crashed[1][0] == -9
    assert sorted(rank_directories(tmp_path / "ckpt")) == [0, 1]
    ok(launch(tmp_path / "ckpt", tmp_path / "resumed", 2))
    resumed_exactly(tmp_path / "resumed", ref)
    assert ref[0][STEPS][0] != ref[1][STEPS][0]   # per-rank state differs: equal digests are a real check
    # The same directory with one and with three ranks: same parameters and optimizer state.
    ok(launch(tmp_path / "ckpt", tmp_path / "w1", 1, "--resume-only"))
    err = ok(launch(tmp_path / "ckpt", tmp_path / "w3", 3, "--resume-only"))
    assert "rank 2 did not exist" in err
    assert digests(tmp_path / "w1-0.txt")[1][STEPS] == ref[0][STEPS]       # rank 0's own state, all of it
    for rank in range(3):
        step, got = digests(tmp_path / f"w3-{rank}.txt")
        assert step == STEPS
        assert got[STEPS][1] == ref[0][STEPS][1]
        if rank < 2:
            assert got[STEPS] == ref[rank][STEPS]                          # its own RNG, sampler, buffers


def test_rank_killed_while_writing_its_share_of_a_full_checkpoint(tmp_path, reference):
    ref, _ = reference
    # Rank 1 dies in the write of its third full-checkpoint share (steps 0, 6, then 12).
    results = launch(tmp_path / "ckpt", tmp_path / "run", 2, fault_rank=1, fault="full-write:3")
    assert results[1][0] == -9
    ok(launch(tmp_path / "ckpt", tmp_path / "resumed", 2))
    start = digests(tmp_path / "resumed-0.txt")[0]
    assert 6 <= start <= 12
    for rank in range(2):
        got_start, got = digests(tmp_path / f"resumed-{rank}.txt")
        assert got_start == start
        assert got[start] == ref[rank][start] and got[STEPS] == ref[rank][STEPS]
    # Rank 0's share of step 12 may have been committed alone: that set is never used. Step 12
    # itself may still be reached by replaying differentials from the set of step 6.
    full_step = int(next(line.split()[1] for line in (tmp_path / "resumed-0.txt").read_text().splitlines()
                         if line.startswith("from-full ")))
    assert full_step <= 6, f"resumed from the incomplete set of step {full_step}"


@pytest.mark.parametrize("flags", [
    ("--compressor", "dense", "--accum", "2", "--unused", "--bucket-view"),
    ("--compressor", "topk-ef", "--static-graph", "--flush", "--full-every", "4", "--batch-steps", "2"),
], ids=["dense-no_sync-unused-bucket_view", "topk_error_feedback-static_graph"])
def test_ddp_options_resume_exactly(tmp_path, flags):
    ok(launch(tmp_path / "ref", tmp_path / "ref", 2, *flags))
    crash_at = 12   # with --flush and full_every 4, step 12 is a durable full checkpoint (residuals exact)
    crashed = launch(tmp_path / "ckpt", tmp_path / "run", 2, *flags, "--crash-at", str(crash_at),
                     "--crash-ranks", "0")
    assert crashed[0][0] == -9
    ok(launch(tmp_path / "ckpt", tmp_path / "resumed", 2, *flags))
    for rank in range(2):
        _, ref = digests(tmp_path / f"ref-{rank}.txt")
        start, got = digests(tmp_path / f"resumed-{rank}.txt")
        if "--flush" in flags:
            assert start == crash_at
        assert 0 < start <= crash_at
        assert got[start] == ref[start], f"rank {rank}: state at step {start} differs"
        assert got[STEPS] == ref[STEPS], f"rank {rank}: final state differs"


def _resume_in_process(directory):
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = recovery.resume(directory, model, opt)
    return start, partition_worker.shared_digest(model, opt)


def test_damaged_or_missing_share_falls_back(tmp_path, reference, caplog):
    ref, directory = reference
    newest = sorted(f for f in os.listdir(directory / "rank-00001") if f.startswith("full-"))[-1]
    path = directory / "rank-00001" / newest
    copy = tmp_path / "ckpt"
    subprocess.run(["cp", "-a", str(directory), str(copy)], check=True)
    damaged = copy / "rank-00001" / newest
    data = bytearray(damaged.read_bytes())
    data[4096 + 100] ^= 0xFF                      # a byte of the share's payload
    damaged.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        start, shared = _resume_in_process(copy)
    assert "fails its checksum" in caplog.text and "falling back" in caplog.text
    assert start.full_step < int(newest[5:17]) and shared == ref[0][int(start)][1]
    damaged.unlink()                              # a missing share: the set is incomplete
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        start, shared = _resume_in_process(copy)
    assert "incomplete" in caplog.text or "does not verify" in caplog.text
    assert start.full_step < int(newest[5:17]) and shared == ref[0][int(start)][1]
    assert path.exists()


def test_partitioned_directory_stays_partitioned_with_one_process(tmp_path, reference):
    _, directory = reference
    copy = tmp_path / "ckpt"
    subprocess.run(["cp", "-a", str(directory), str(copy)], check=True)
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, copy,
                       compressor=lowdiff.TopK(ratio=0.1, min_numel=64), full_every=6, batch_steps=3)
    start = recovery.resume(copy, model, opt)
    model(torch.randn(8, 16)).sum().backward()
    opt.step()
    opt.close()
    assert not (copy / "MANIFEST.json").exists()          # shares "0 of 1" in rank-00000/
    again, _ = _resume_in_process(copy)
    assert int(again) == int(start) + 1



def test_cli_understands_partitioned_directories(tmp_path, reference, capsys):
    from lowdiff.cli.main import main

    ref, directory = reference
    assert main(["inspect", str(directory)]) == 0
    assert "share 1 of 2" in capsys.readouterr().out
    assert main(["verify", str(directory)]) == 0
    assert f"recoverable steps 12..{STEPS}" in capsys.readouterr().out
    assert main(["export", str(directory), "-o", str(tmp_path / "out.pt")]) == 0
    assert partition_worker.exported_step_and_digest(tmp_path / "out.pt") == (STEPS, ref[0][STEPS][1])
    exported = torch.load(tmp_path / "out.pt", weights_only=True)
    # DCP from a DDP directory (no DTensor chunks): every tensor whole, the torch export's values
    assert main(["export", str(directory), "--format", "dcp", "-o", str(tmp_path / "dcp")]) == 0
    import warnings

    import torch.distributed.checkpoint as dcp
    metadata = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    loaded = {key: torch.empty_like(value) for key, value in exported["model"].items()}
    assert all(len(metadata[key].chunks) == 1 for key in loaded)
    with warnings.catch_warnings():   # the loader's own no_dist warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(loaded[key], value) for key, value in exported["model"].items())
    copy = tmp_path / "ckpt"
    subprocess.run(["cp", "-a", str(directory), str(copy)], check=True)
    damaged = sorted((copy / "rank-00001").glob("diff-*"))[-1]
    damaged.write_bytes(damaged.read_bytes()[:-40] + bytes(40))
    assert main(["verify", str(copy)]) == 1
    assert "CORRUPT" in capsys.readouterr().out


def _copy(directory, tmp_path):
    return copy_directory(directory, tmp_path / "ckpt")


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_damaged_or_missing_rank_manifest_loses_nothing(tmp_path, reference, caplog, capsys, damage):
    ref, directory = reference
    copy = _copy(directory, tmp_path)
    manifest = copy / "rank-00001" / "MANIFEST.json"
    files = checkpoint_files(copy / "rank-00001")
    data = manifest.read_bytes()
    if damage == "corrupt":
        manifest.write_bytes(data.replace(b'"step": 12', b'"step": 13'))   # valid JSON, checksum fails
    elif damage == "truncate":
        manifest.write_bytes(data[:len(data) // 2])
    else:
        manifest.unlink()
    assert cli(["verify", str(copy)]) == 1                       # reported, naming the manifest
    out = capsys.readouterr().out
    assert "rank-00001/MANIFEST.json: " in out and "rebuilt from the share files" in out
    assert "recoverable steps 12..16" in out                     # the shares it listed are still found
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        start, shared = _resume_in_process(copy)
    assert int(start) == STEPS and shared == ref[0][STEPS][1]    # the newest complete step, exact
    assert "rank-00001" in caplog.text and "rebuil" in caplog.text
    assert checkpoint_files(copy / "rank-00001") == files       # nothing the manifest lost is deleted
    if damage == "truncate":   # real ranks: both land on the newest step with their own state
        ok(launch(copy, tmp_path / "w2", 2, "--resume-only"))
        for rank in range(2):
            step, got = digests(tmp_path / f"w2-{rank}.txt")
            assert step == STEPS and got[STEPS] == ref[rank][STEPS]
        assert read_manifest(str(copy / "rank-00001")).files() == set(files)   # listed again


def _record_offset(path, step):
    index = parse_diff_share(str(path), path.read_bytes())
    return next(offset for s, offset, _ in index.batch.records if s == step)


@pytest.mark.parametrize("tear", ["truncated", "record-corrupted"])
def test_torn_differential_share_ends_the_chain(tmp_path, reference, caplog, capsys, tear):
    ref, directory = reference
    copy = _copy(directory, tmp_path)
    share = copy / "rank-00001" / next(n for n in checkpoint_files(copy / "rank-00001")
                                       if n.startswith("diff-000000000013-"))   # steps 13..15
    data = bytearray(share.read_bytes())
    if tear == "truncated":
        share.write_bytes(bytes(data[:len(data) - 100]))
        expected = 12              # without its index the share's parameters are unknown: none used
    else:
        data[_record_offset(share, 14) + 40] ^= 0xFF   # inside the record of step 14
        share.write_bytes(bytes(data))
        expected = 13
    assert cli(["verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert f"CORRUPT  {share}" in out and f"recoverable steps 12..{expected}" in out
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        start, shared = _resume_in_process(copy)
    assert int(start) == expected and shared == ref[0][expected][1]
    assert share.name in caplog.text
    assert f"resuming at step {expected}" in caplog.text or f"ends at step {expected}" in caplog.text


def _travels(path):
    """({step: (full digest, shared digest)}, {step: error message})."""
    got, errors = {}, {}
    for line in path.read_text().splitlines():
        kind, step, rest = line.split(" ", 2)
        if kind == "travel":
            got[int(step)] = tuple(rest.split())
        else:
            errors[int(step)] = rest
    return got, errors


@pytest.mark.parametrize("world", [1, 2])
def test_time_travel_to_every_retained_step(tmp_path, reference, world):
    ref, directory = reference
    retained = list(range(6, STEPS + 1))                 # full sets 6 and 12 (keep_full 2), to step 16
    steps = ",".join(str(k) for k in retained + [5, STEPS + 1])
    ok(launch(directory, tmp_path / "travel", world, "--travel", steps))
    for rank in range(world):
        got, errors = _travels(tmp_path / f"travel-{rank}.txt")
        assert sorted(got) == retained
        for k in retained:
            assert got[k] == ref[rank][k], f"rank {rank}: state at step {k} differs"
        for k in (5, STEPS + 1):
            assert f"step {k} is not retained; retained steps: 6..{STEPS}" in errors[k]


def test_durable_step_is_what_every_share_reaches(tmp_path, reference, capsys):
    _, directory = reference
    copy = _copy(directory, tmp_path)
    rank1 = str(copy / "rank-00001")
    manifest = read_manifest(rank1)
    newest = max(manifest.batches, key=lambda b: b.last)          # rank 1's share of step 16
    manifest.batches.remove(newest)
    write_manifest(rank1, manifest)
    os.unlink(os.path.join(rank1, newest.file))
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, copy,
                       compressor=lowdiff.TopK(ratio=0.1, min_numel=64), full_every=6, batch_steps=3)
    try:
        assert opt.durable_step == STEPS - 1                      # rank 0's own shares reach 16
        stats = opt.stats()
        assert stats["durable_step"] == STEPS - 1 and stats["rank_durable_step"] == STEPS
        assert int(recovery.resume(copy, model, opt)) == STEPS - 1
    finally:
        opt.close()
    assert cli(["inspect", str(copy)]) == 0
    assert f"durable step   {STEPS - 1}" in capsys.readouterr().out


def test_retention_cleans_the_ranks_a_resumed_run_dropped(tmp_path, reference, capsys):
    """2 ranks to step 16, then 1 rank: rank 0 cleans rank-00001/ as it retires the old sets, and
    not before (the older complete set stays while it is among the newest keep_full)."""
    _, directory = reference
    copy = _copy(directory, tmp_path)
    old = checkpoint_files(copy / "rank-00001")
    ok(launch(copy, tmp_path / "one", 1, steps=20))   # resumed at 16: full sets 12 (2 shares), 16+
    kept = checkpoint_files(copy / "rank-00001")
    assert any(n.startswith("full-000000000012-") for n in kept) and not any(n.startswith("full-000000000006-")
                                                                             for n in kept)
    assert set(kept) < set(old)
    assert cli(["verify", str(copy)]) == 0
    capsys.readouterr()
    # Two newer complete sets of 1 share: the old go. Killed after the first deletion in rank-00001/:
    # its committed manifest lists only files that exist, and the next start finishes the deletions.
    killed = launch(copy, tmp_path / "killed", 1, steps=32, fault_rank=0, fault="dropped-clean:1")
    assert killed[0][0] == -9
    listed = read_manifest(str(copy / "rank-00001")).files()
    assert listed < set(kept) and listed <= set(checkpoint_files(copy / "rank-00001"))
    assert checkpoint_files(copy / "rank-00001") != sorted(listed)   # retired files are left over
    ok(launch(copy, tmp_path / "one", 1, steps=32))
    assert not (copy / "rank-00001").exists()                       # emptied, then removed
    assert len([n for n in checkpoint_files(copy / "rank-00000") if n.startswith("full-")]) == 2
    assert cli(["verify", str(copy)]) == 0
    _, trained = digests(tmp_path / "one-0.txt")
    step, got = _resume_in_process(copy)
    assert int(step) == 32 and got == trained[32][1]               # nothing the newest set needs went


def test_auto_settings_are_refused_under_ddp(tmp_path):
    """Each rank's controller would pick its own interval and batch size from its own measurements,
    and shares cut at different steps never form a set: refused at wrap(), before anything is written."""
    results = launch(tmp_path / "ckpt", tmp_path / "d", 2, "--full-every", "auto")
    for code, err in results:
        assert code != 0 and "full_every='auto' is not supported under torch.distributed" in err, err
    assert not any(files for _, _, files in os.walk(tmp_path / "ckpt"))
