"""The manifest: chain planning, durable step, JSON round trip and checksums, and retention in
CheckpointStore (which must never delete what the newest full checkpoint's chain needs)."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowdiff
from lowdiff.errors import CorruptCheckpointError, VersionMismatchError
from lowdiff.store.directory import CheckpointStore
from lowdiff.store.inventory import load_view
from lowdiff.store.manifest import (
    MANIFEST_NAME,
    BatchEntry,
    FullEntry,
    Manifest,
    chain_end,
    diff_name,
    full_name,
    plan_chain,
    read_manifest,
    write_manifest,
)
from lowdiff.store.retention import KeepLast


def full(step, session="aaaaaaaa"):
    return FullEntry(step, full_name(step, session), 100 + step, session)


def batch(first, last, session="aaaaaaaa"):
    return BatchEntry(first, last, diff_name(first, last, session), 10 * (last - first + 1), session)


# ------------------------------------------------------------------ plan_chain / durable_step
def test_chain_follows_contiguous_batches_and_stops_at_a_gap():
    m = Manifest([full(0), full(6)], [batch(1, 3), batch(4, 6), batch(7, 9), batch(11, 12)])
    assert plan_chain(m, 0) == [batch(1, 3), batch(4, 6), batch(7, 9)]
    assert plan_chain(m, 6) == [batch(7, 9)]
    assert chain_end(m, 6, plan_chain(m, 6)) == 9
    assert plan_chain(m, 9) == []
    assert chain_end(m, 9, []) == 9
    assert m.durable_step() == 9  # 11-12 is unreachable: step 10 is missing


def test_chain_prefers_the_newest_commit_when_two_batches_start_at_the_same_step():
    old, new = batch(5, 8, "aaaaaaaa"), batch(5, 6, "bbbbbbbb")
    m = Manifest([full(4)], [batch(1, 4), old, batch(9, 12), new, batch(7, 7, "bbbbbbbb")])
    assert plan_chain(m, 4) == [new, batch(7, 7, "bbbbbbbb")]
    assert m.durable_step() == 7
    m_old_last = Manifest([full(4)], [new, batch(7, 7, "bbbbbbbb"), old, batch(9, 12)])
    assert plan_chain(m_old_last, 4) == [old, batch(9, 12)]
    assert m_old_last.durable_step() == 12


def test_durable_step_is_the_best_reachable_over_all_fulls():
    assert Manifest().durable_step() == -1
    assert Manifest([], [batch(1, 5)]).durable_step() == -1, "batches without a full checkpoint are not durable"
    assert Manifest([full(0)], []).durable_step() == 0
    assert Manifest([full(0)], [batch(2, 5)]).durable_step() == 0
    # the newest full is past the end of the older full's chain
    assert Manifest([full(0), full(20)], [batch(1, 4)]).durable_step() == 20
    # an older full's chain reaches further than the newest full
    assert Manifest([full(0), full(3)], [batch(1, 2), batch(3, 9)]).durable_step() == 9


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(0, 5)), max_size=12),
       st.lists(st.integers(0, 30), max_size=4))
def test_durable_step_matches_a_step_by_step_walk(spans, full_steps):
    batches = [batch(first, first + length) for first, length in spans]
    m = Manifest([full(s) for s in full_steps], batches)
    best = -1
    for base in full_steps:
        cursor = base
        while True:
            starting = [b for b in batches if b.first == cursor + 1]
            if not starting:
                break
            cursor = starting[-1].last
        best = max(best, cursor)
    assert m.durable_step() == best
    for base in full_steps:
        chain = plan_chain(m, base)
        expected = base + 1
        for b in chain:  # every chain is contiguous
            assert b.first == expected
            expected = b.last + 1


# ------------------------------------------------------------------ JSON round trip, checksum
manifests = st.builds(
    Manifest,
    st.lists(st.builds(full, st.integers(0, 10**9), st.sampled_from(["aaaaaaaa", "0123abcd"])), max_size=5),
    st.lists(st.builds(lambda a, n, s: batch(a, a + n, s), st.integers(1, 10**9), st.integers(0, 64),
                       st.sampled_from(["aaaaaaaa", "0123abcd"])), max_size=8))


@settings(max_examples=100, deadline=None)
@given(manifests)
def test_manifest_json_round_trip(m):
    again = Manifest.from_json(m.to_json(), "M")
    assert again == m
    outer = json.loads(m.to_json())
    assert outer["manifest"]["version"] == 1
    assert outer["crc32"] == zlib.crc32(json.dumps(outer["manifest"], indent=1, sort_keys=True).encode())
    # the bytes are those of the whole file encoded at once (to_json encodes the body only once)
    assert m.to_json() == json.dumps(outer, indent=1, sort_keys=True).encode()


def test_write_and_read_manifest(tmp_path):
    assert read_manifest(str(tmp_path)) is None
    m = Manifest([full(0), full(10)], [batch(1, 5), batch(6, 10), batch(11, 11)])
    write_manifest(str(tmp_path), m)
    assert read_manifest(str(tmp_path)) == m
    assert sorted(os.listdir(tmp_path)) == [MANIFEST_NAME], "no temp file may be left behind"


@settings(max_examples=150, deadline=None)
@given(manifests.filter(lambda m: m.fulls or m.batches), st.data())
def test_any_bit_flip_or_truncation_of_the_manifest_is_detected(m, data):
    blob = bytearray(m.to_json())
    if data.draw(st.booleans(), label="truncate"):
        blob = blob[:data.draw(st.integers(0, len(blob) - 1), label="cut")]
    else:
        blob[data.draw(st.integers(0, len(blob) - 1), label="byte")] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    with pytest.raises(CorruptCheckpointError) as info:
        Manifest.from_json(bytes(blob), "dir/MANIFEST.json")
    assert info.value.path == "dir/MANIFEST.json"


def test_manifest_of_another_version_is_rejected():
    body = {"version": 2, "fulls": [], "batches": []}
    text = json.dumps(body, indent=1, sort_keys=True)
    data = json.dumps({"crc32": zlib.crc32(text.encode()), "manifest": body}).encode()
    with pytest.raises(VersionMismatchError, match="version 2"):
        Manifest.from_json(data, "M")


def test_damaged_manifest_is_rebuilt_with_a_warning(tmp_path):
    (tmp_path / MANIFEST_NAME).write_bytes(b'{"crc32": 1, "manifest": {"version": 1, "fulls": [], "batches": []}}')
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        read_manifest(str(tmp_path))
    warnings = []
    assert load_view(str(tmp_path), warn=warnings.append) == Manifest()
    assert len(warnings) == 1 and MANIFEST_NAME in warnings[0]


# ------------------------------------------------------------------ retention
class Simulation:
    """Drives a CheckpointStore the way the background writers do: batches are committed in step
    order, a full checkpoint of step s is taken when the diff writer is sealed at s and committed
    some time later (the next one is taken only after it is committed)."""

    def __init__(self, directory, keep_full):
        self.store = CheckpointStore(directory, KeepLast(keep_full))
        self.directory = self.store.directory
        self.step = 0
        self.batch_start = 1
        self.pending_full = None
        self.base_taken = False
        self.last_full = None

    def touch(self, path):
        with open(path, "wb") as f:
            f.write(b"x")

    def commit_batch(self, length):
        first, last = self.batch_start, self.batch_start + length - 1
        path = self.store.batch_path(first, last)
        self.touch(path)
        self.store.commit_batch(first, last, path, 1)
        self.batch_start = last + 1
        self.step = last

    def take_full(self):
        assert self.pending_full is None
        assert self.batch_start == self.step + 1  # sealed: the chain of the previous full reaches here
        self.pending_full = self.step

    def commit_full(self):
        path = self.store.full_path(self.pending_full)
        self.touch(path)
        self.store.commit_full(self.pending_full, path, 1, base=not self.base_taken)
        self.base_taken = True
        self.last_full, self.pending_full = self.pending_full, None

    def check(self):
        m = self.store.manifest
        assert read_manifest(self.directory) == m, "the committed manifest is the store's manifest"
        on_disk = {n for n in os.listdir(self.directory) if n.endswith((".ldf", ".ldd"))}
        listed = {f.file for f in m.fulls} | {b.file for b in m.batches}
        assert listed == on_disk, "exactly the listed files exist"
        assert len(m.fulls) <= self.store.policy.n
        if not m.fulls:
            return
        # every kept full checkpoint (in particular the newest) still reaches the newest step
        for f in m.fulls:
            chain = plan_chain(m, f.step)
            assert chain_end(m, f.step, chain) == self.step, f"full {f.step} no longer reaches step {self.step}"
        assert m.durable_step() == self.step


ops = st.lists(st.one_of(st.tuples(st.just("batch"), st.integers(1, 5)), st.just(("full",))), max_size=40)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), ops)
def test_retention_never_deletes_what_a_kept_full_checkpoint_needs(tmp_path_factory, keep_full, plan):
    sim = Simulation(str(tmp_path_factory.mktemp("store")), keep_full)
    try:
        sim.take_full()        # the base checkpoint at step 0
        for op in plan:
            if op[0] == "batch":
                sim.commit_batch(op[1])
            elif sim.pending_full is not None:
                sim.commit_full()
            elif sim.step > sim.last_full:  # the wrapper never takes two fulls at one step
                sim.take_full()
            if sim.store.manifest.fulls:
                sim.check()
        if sim.pending_full is not None:
            sim.commit_full()
        sim.check()
        assert max(f.step for f in sim.store.manifest.fulls) == sim.last_full, "the newest full is kept"
    finally:
        sim.store.close()


def test_retention_keeps_the_newest_keep_full(tmp_path):
    sim = Simulation(str(tmp_path), keep_full=2)
    try:
        for _ in range(4):
            sim.take_full()
            sim.commit_batch(3)
            sim.commit_full()
            sim.commit_batch(2)
            sim.check()
        m = sim.store.manifest
        assert [f.step for f in m.fulls] == [10, 15]
        assert [(b.first, b.last) for b in m.batches] == [(11, 13), (14, 15), (16, 18), (19, 20)]
    finally:
        sim.store.close()


def test_a_resumed_session_drops_the_abandoned_timeline(tmp_path):
    first = Simulation(str(tmp_path), keep_full=3)
    first.take_full()
    first.commit_full()
    for _ in range(4):
        first.commit_batch(3)   # steps 1..12
    first.store.close()
    old_files = {b.file for b in first.store.manifest.batches}

    # a new session resumed at step 6 (say, records 7.. did not verify) and commits its base full
    store = CheckpointStore(str(tmp_path), KeepLast(3))
    try:
        assert store.manifest == first.store.manifest
        path = store.full_path(6)
        open(path, "wb").close()
        store.commit_full(6, path, 1, base=True)
        m = store.manifest
        assert [(f.step, f.session) for f in m.fulls] == [(0, first.store.session), (6, store.session)]
        assert [(b.first, b.last) for b in m.batches] == [(1, 3), (4, 6)]
        on_disk = {n for n in os.listdir(tmp_path) if n.endswith(".ldd")}
        assert on_disk == {b.file for b in m.batches} and on_disk < old_files
        assert m.durable_step() == 6
    finally:
        store.close()


def test_the_directory_lock_is_exclusive(tmp_path):
    store = CheckpointStore(str(tmp_path))
    try:
        with pytest.raises(lowdiff.CheckpointLockedError, match=str(os.getpid())):
            CheckpointStore(str(tmp_path))
    finally:
        store.close()
    CheckpointStore(str(tmp_path)).close()  # released


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_next_store_deletes_only_retired_files_and_temp_files_of_dead_writers(tmp_path):
    sim = Simulation(str(tmp_path), keep_full=1)
    sim.take_full()
    sim.commit_full()
    sim.commit_batch(2)
    sim.take_full()
    sim.commit_full()          # retires full 0 and batch 1-2
    retired = [r.file for r in sim.store.manifest.retired]
    assert len(retired) == 2 and read_manifest(str(tmp_path)).retired == sim.store.manifest.retired
    sim.store.close()
    # a crash between the manifest commit and the unlinks leaves the retired files behind
    for name in retired:
        (tmp_path / name).write_bytes(b"x")
    dead, alive = _dead_pid(), os.getppid()
    temps = {f".diff-000000000003-000000000004-cccccccc.ldd.tmp-{dead}-0a0b0c0d": False,
             f"MANIFEST.json.tmp-{dead}": False,
             f".full-000000000005-cccccccc.ldf.tmp-{alive}-0a0b0c0d": True,    # its writer may still run
             ".notes.tmp-1-2": True, "my.tmp-data": True}                        # not names lowdiff writes
    for name in temps:
        (tmp_path / name).write_bytes(b"x")
    unexplained = tmp_path / full_name(99, "cccccccc")   # unlisted, not retired: never deleted
    unexplained.write_bytes(b"x")
    (tmp_path / full_name(98, "dddddddd")).mkdir()        # a directory named like a checkpoint
    listed = sim.store.manifest.files()
    CheckpointStore(str(tmp_path)).close()
    left = set(os.listdir(tmp_path))
    assert not set(retired) & left
    assert {name for name, keep in temps.items() if keep} <= left
    assert not {name for name, keep in temps.items() if not keep} & left
    assert unexplained.exists() and (tmp_path / full_name(98, "dddddddd")).is_dir()
    assert listed <= left


# ------------------------------------------------------------------ the format package's JSON files
def test_the_manifest_schema_lives_in_the_format_package():
    """store.manifest adds chains to the format package's record; its entries are format's own."""
    from lowdiff.format import container
    assert issubclass(Manifest, container.ManifestRecord) and FullEntry is container.FullEntry
    m = Manifest([full(0)], [batch(1, 3)], run="0" * 16)
    assert type(Manifest.from_json(m.to_json(), "m")) is Manifest
    assert dataclasses.replace(m, run=None) == Manifest([full(0)], [batch(1, 3)])


def test_the_json_helper_commits_atomically_and_cleans_dead_temporaries(tmp_path):
    from lowdiff.format.container import read_file, write_json_file
    from lowdiff.store.inventory import is_dead_temp
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".TIERS.json.tmp-{dead.pid}-abcd"          # a writer killed mid-write
    live = tmp_path / f".TIERS.json.tmp-{os.getpid()}-abcd"       # ours: never removed
    other = tmp_path / f".CONTROLLER.json.tmp-{dead.pid}-abcd"  # another file's: not this writer's business
    for path in (stale, live, other):
        path.write_bytes(b"partial")
    target = str(tmp_path / "TIERS.json")
    assert read_file(target) is None
    write_json_file(target, b'{"a": 1}', is_dead_temp=is_dead_temp)
    assert read_file(target) == b'{"a": 1}'
    assert not stale.exists() and live.exists() and other.exists()
    before = os.stat(target).st_ino
    write_json_file(target, b'{"a": 1}', unless_same=True)    # the same bytes: not rewritten
    assert os.stat(target).st_ino == before
    write_json_file(target, b'{"a": 2}', unless_same=True)
    assert read_file(target) == b'{"a": 2}' and os.stat(target).st_ino != before
    assert sorted(os.listdir(tmp_path)) == sorted([live.name, other.name, "TIERS.json"])
