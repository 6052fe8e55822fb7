"""Golden bytes: the worked example of docs/format.md, built by hand from the spec (struct, json,
zlib, a CRC-32C written here, zstd), is read by lowdiff; and lowdiff's own output for the same
inputs is the same bytes. A change to either side that the spec does not describe fails here.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import struct
import zlib

import torch
import zstandard

import fastio
import recovery
from lowdiff.control.controlstate import read_state, write_state
from lowdiff.distributed.drives import place_rank_directory
from lowdiff.format import container
from lowdiff.format.batchfile import write_batch
from lowdiff.format.container import BucketManifest
from lowdiff.format.fullckpt import Snapshot
from lowdiff.format.records import StepRecord, encode_record
from lowdiff.format.schema import FORMAT_VERSION, Section, TensorEntry, TrainedWith
from lowdiff.format.sharefile import (
    FullShareIndex,
    Piece,
    read_diff_share_index,
    read_full_share_index,
    write_diff_share,
    write_full_share,
)
from lowdiff.step.compress import Compressed
from lowdiff.store.manifest import BatchEntry, FullEntry, Manifest, RetiredEntry, read_manifest, write_manifest
from lowdiff.store.rankdirs import rank_directory
from lowdiff.store.retention import KeepLast
from lowdiff.tiers.marker import read_marker, read_tiers, write_marker
from lowdiff.tiers.policy import Tiers

RUN, SESSION = "0123456789abcdef", "0a1b2c3d"
FULL_NAME = f"full-000000000000-{SESSION}.ldf"
DIFF_NAME = f"diff-000000000001-000000000001-{SESSION}.ldd"
DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "format.md")
W = [1.0, 2.0]
GRAD_W, SPARSE_V, INDICES_V = [0.25, -0.25], [1.0, 2.0], [3, 7]


# ------------------------------------------------------------------ the spec, by hand
def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, reflected 0x82F63B78), bit by bit: independent of fastio's."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def preamble(kind: int) -> bytes:
    return b"LOWDIFF\x00" + struct.pack("<HH4x", 1, kind)


def trailer(index_offset: int, index: bytes, kind: int) -> bytes:
    return struct.pack("<QQIHH8s", index_offset, len(index), zlib.crc32(index), 1, kind, b"LDINDEX\x00")


def index_json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def small_objects(obj) -> bytes:
    """The "small objects" encoding of a tree without tensors: "J", u32 length, [skeleton, []]."""
    head = json.dumps([obj, []], separators=(",", ":")).encode()
    return b"J" + struct.pack("<I", len(head)) + head


def f32(values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def sgd_group() -> dict:
    return torch.optim.SGD([torch.zeros(1), torch.zeros(1)], lr=0.5).state_dict()["param_groups"][0]


def full_skeleton() -> dict:
    return {"model": {"w": {"__lowdiff_tensor__": "/model/w"}, "v": {"__lowdiff_tensor__": "/model/v"}},
            "optimizer": {"state": {}, "param_groups": [sgd_group()]}, "scheduler": None, "extra": {},
            "rng": {}, "residuals": {}, "grad_scaler": None}


def hand_full() -> bytes:
    w, v = f32(W), bytes(40)
    payload = (w + bytes(56) + v).ljust(4096, b"\0")          # v: the next 64-byte boundary
    objects = small_objects(full_skeleton())
    index = index_json({
        "version": 1, "kind": "full", "step": 0, "session": SESSION, "run": RUN, "payload_bytes": 4096,
        "tensors": [{"key": "/model/w", "dtype": "float32", "shape": [2], "offset": 4096, "nbytes": 8,
                     "crc32c": crc32c(w)},
                    {"key": "/model/v", "dtype": "float32", "shape": [10], "offset": 4160, "nbytes": 40,
                     "crc32c": crc32c(v)}],
        "objects": {"offset": 8192, "nbytes": len(objects), "crc32c": crc32c(objects)},
        "param_names": ["w", "v"], "param_aliases": {"w": 0, "v": 1},
        "optimizer_class": "torch.optim.sgd.SGD", "compressor": "TopK(ratio=0.2)"})
    body = preamble(1).ljust(4096, b"\0") + payload + objects
    return body + index + trailer(len(body), index, 1)


def record_objects() -> dict:
    return {"groups_used": [{"lr": 0.5}], "groups_after": [{"lr": 0.5}], "rng": {}, "buffers": {}, "extra": {}}


RECORD_OFFSET = 16   # the example batch's only record, right after the preamble


def hand_record() -> bytes:
    objects = small_objects(record_objects())
    meta = json.dumps({"step": 1, "skipped": False, "objects_bytes": len(objects),
                       "grads": [["dense", 2, 0, "float32"], ["sparse", 10, 2, "float32", 2]]},
                      separators=(",", ":")).encode()
    deltas = struct.pack("<2H", INDICES_V[0], INDICES_V[1] - INDICES_V[0])
    packed = zstandard.ZstdCompressor(level=1).compress(struct.pack("<I", len(meta)) + meta + objects + deltas)
    raw = f32(GRAD_W) + f32(SPARSE_V)
    misaligned = (RECORD_OFFSET + 32 + len(packed)) % 8
    if misaligned:   # the skippable frame that puts raw at a multiple of 8 in the file
        packed += struct.pack("<II", 0x184D2A50, 8 - misaligned) + bytes(8 - misaligned)
    header = struct.pack("<4sHHQIQI", b"LDRC", 1, 0, 1, len(packed), len(raw), zlib.crc32(packed + raw))
    return header + packed + raw


def hand_batch() -> bytes:
    record = hand_record()
    index = index_json({"version": 1, "kind": "diff", "session": SESSION, "run": RUN, "first": 1, "last": 1,
                        "records": [[1, RECORD_OFFSET, len(record)]]})
    body = preamble(2) + record
    return body + index + trailer(len(body), index, 2)


def hand_manifest(full: bytes, batch: bytes) -> bytes:
    body = {"version": 1, "run": RUN, "retired": [],
            "fulls": [{"step": 0, "file": FULL_NAME, "nbytes": len(full), "session": SESSION}],
            "batches": [{"first": 1, "last": 1, "file": DIFF_NAME, "nbytes": len(batch), "session": SESSION}]}
    text = json.dumps(body, indent=1, sort_keys=True)
    return json.dumps({"crc32": zlib.crc32(text.encode()), "manifest": body}, indent=1, sort_keys=True).encode()


def json_file(body) -> bytes:
    """The encoding of MANIFEST.json's parts, CONTROLLER.json and TIERS.json."""
    return json.dumps(body, indent=1, sort_keys=True).encode()


SHARE_OWN = f32([5.0])   # the full share's one own tensor


def hand_full_share() -> bytes:
    """Share 0 of 1 of a full set: shared payload `w` (4096 bytes), an own region holding `/rng/x`."""
    w = f32(W)
    shared = w.ljust(4096, b"\0")
    own = SHARE_OWN.ljust(4096, b"\0")
    objects = small_objects(full_skeleton())
    index = index_json({
        "version": 1, "kind": "full-share", "step": 0, "session": SESSION, "run": RUN,
        "share": {"index": 0, "count": 1, "start": 0, "end": 4096}, "shared_bytes": 4096,
        "layout": [{"key": "/model/w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}],
        "pieces": [{"key": "/model/w", "offset": 0, "nbytes": 8, "crc32c": crc32c(w)}], "own_bytes": 4096,
        "tensors": [{"key": "/rng/x", "dtype": "float32", "shape": [1], "offset": 8192, "nbytes": 4,
                     "crc32c": crc32c(SHARE_OWN)}],
        "objects": {"offset": 12288, "nbytes": len(objects), "crc32c": crc32c(objects)},
        "param_names": ["w", "v"], "param_aliases": {"w": 0, "v": 1},
        "optimizer_class": "torch.optim.sgd.SGD", "compressor": "TopK(ratio=0.2)"})
    body = preamble(3).ljust(4096, b"\0") + shared + own + objects
    return body + index + trailer(len(body), index, 3)


def hand_diff_share() -> bytes:
    """Share 0 of 1 of step 1's differential, owning both parameters: the example batch's record."""
    record = hand_record()
    index = index_json({"version": 1, "kind": "diff-share", "session": SESSION, "run": RUN, "first": 1,
                        "last": 1, "records": [[1, RECORD_OFFSET, len(record)]],
                        "share": {"index": 0, "count": 1}, "slots": [0, 1]})
    body = preamble(4) + record
    return body + index + trailer(len(body), index, 4)


SAMPLES = {"step_s": [0.25, 0.5], "restart_s": [9.75]}
SETTINGS = {"full_every": 120, "batch_steps": 4, "differentials": True}


def hand_controller() -> bytes:
    return json_file({"version": 1, "samples": SAMPLES, "settings": SETTINGS})


def hand_tiers(shared_dir: str) -> bytes:
    return json_file({"version": 1, "shared_dir": shared_dir, "local_policy": "keep-last 3",
                      "shared_policy": "keep-last 2", "max_lag_steps": 500})


def hand_drive(rank_dir: str) -> bytes:
    return json_file({"version": 1, "dir": rank_dir})


BUCKET_MANIFEST = "MANIFEST-000000000000.json"


def hand_bucket_manifest(full: bytes, batch: bytes) -> bytes:
    """Commit 0 of an object-store tier holding the example's two files (format.md, "Shared tier in
    an object store"): MANIFEST.json's content and each file's size and CRC-32C."""
    body = {"version": 1, "seq": 0, "manifest": json.loads(hand_manifest(full, batch)),
            "objects": {DIFF_NAME: {"nbytes": len(batch), "crc32c": crc32c(batch)},
                        FULL_NAME: {"nbytes": len(full), "crc32c": crc32c(full)}}}
    return json_file({"crc32": zlib.crc32(json_file(body)), "bucket_manifest": body})


def chunk_entry(shape: list) -> dict:
    """The chunk entry (docs/format.md, "Sharded state") of rank 0's half of a tensor split on 2 ranks."""
    return {"global_shape": [2 * shape[0], *shape[1:]], "mesh_shape": [2], "mesh_dim_names": None,
            "placements": ["S0"], "offsets": [0] * len(shape), "shape": list(shape)}


def lowdiff_writes_every_kind(directory) -> dict:
    """Every file kind as lowdiff writes it for the example's inputs, by name: its bytes."""
    snapshot = Snapshot()
    state = {"model": {"w": torch.tensor(W), "v": torch.zeros(10)},
             "optimizer": {"state": {}, "param_groups": [sgd_group()]}, "scheduler": None, "extra": {},
             "rng": {}, "residuals": {}, "grad_scaler": None}
    snapshot.stage(0, state, TrainedWith(("w", "v"), {"w": 0, "v": 1}, "torch.optim.sgd.SGD", "TopK(ratio=0.2)"))
    snapshot.copy(on_training_thread=True)
    snapshot.persist(str(directory / FULL_NAME), SESSION, run=RUN)

    record = StepRecord(1, False, [Compressed("dense", 2, torch.tensor(GRAD_W)),
                                   Compressed("sparse", 10, torch.tensor(SPARSE_V),
                                              torch.tensor(INDICES_V, dtype=torch.int32))], record_objects())
    write_batch(str(directory / DIFF_NAME), SESSION, [(1, encode_record(record))], run=RUN)
    write_diff_share(str(directory / "diff-share.ldd"), SESSION, [(1, encode_record(record))], run=RUN,
                     share=(0, 1), slots=[0, 1])

    w = f32(W)
    objects = small_objects(full_skeleton())

    def share_index(objects_section: Section) -> FullShareIndex:
        layout = ({"key": "/model/w", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8},)
        return FullShareIndex(0, SESSION, RUN, 0, 1, 4096, layout, (Piece("/model/w", 0, 8, fastio.crc32c(w)),),
                              4096, (TensorEntry(8192, 4, fastio.crc32c(SHARE_OWN), key="/rng/x",
                                                 dtype="float32", shape=(1,)),),
                              objects_section, ("w", "v"), {"w": 0, "v": 1}, "torch.optim.sgd.SGD",
                              "TopK(ratio=0.2)")
    write_full_share(str(directory / "full-share.ldf"), w.ljust(4096, b"\0") + SHARE_OWN.ljust(4096, b"\0"),
                     objects, share_index)
    # The same shares as a sharded (DTensor) run writes them: with the optional field `dtensors`, and
    # as HSDP writes them (share 1 of 2, a chunk held by share 0): with `elsewhere` too.
    write_full_share(str(directory / "full-share-dtensors.ldf"),
                     w.ljust(4096, b"\0") + SHARE_OWN.ljust(4096, b"\0"), objects,
                     lambda section: dataclasses.replace(share_index(section), index=1, count=2,
                                                         dtensors={"/rng/x": chunk_entry([1]),
                                                                   "/model/v": chunk_entry([2])},
                                                         elsewhere={"/model/v": {"share": 0, "dtype": "float32"}}))
    write_diff_share(str(directory / "diff-share-dtensors.ldd"), SESSION, [(1, encode_record(record))], run=RUN,
                     share=(0, 2), slots=[0, 1], dtensors={0: chunk_entry([2]), 2: chunk_entry([2])},
                     elsewhere={2: 1})

    full, batch = (directory / FULL_NAME).read_bytes(), (directory / DIFF_NAME).read_bytes()
    write_manifest(str(directory), Manifest([FullEntry(0, FULL_NAME, len(full), SESSION)],
                                            [BatchEntry(1, 1, DIFF_NAME, len(batch), SESSION)], RUN, []))
    write_state(str(directory), SAMPLES, SETTINGS)
    write_marker(str(directory), Tiers(str(directory / "shared")), KeepLast(3))
    names = (FULL_NAME, DIFF_NAME, "full-share.ldf", "diff-share.ldd", "MANIFEST.json", "CONTROLLER.json",
             "TIERS.json", "full-share-dtensors.ldf", "diff-share-dtensors.ldd")
    written = {name: (directory / name).read_bytes() for name in names}
    # Rank 1 of a partitioned root placed on the second of two drives (local rank 1).
    root, drive = directory / "spread", directory / "nvme1"
    place_rank_directory(str(root), 1, (str(root), str(drive)), 1)
    written["DRIVE.json"] = (root / "rank-00001" / "DRIVE.json").read_bytes()
    # The bucket's commit object, as lowdiff.tiers.bucket encodes it (no bucket needed for its bytes).
    written[BUCKET_MANIFEST] = BucketManifest(0, read_manifest(str(directory)), {
        name: (len(written[name]), fastio.crc32c(written[name])) for name in (FULL_NAME, DIFF_NAME)}).to_json()
    return written


# ------------------------------------------------------------------ the tests
def test_a_directory_built_by_hand_from_the_spec_is_read_by_lowdiff(tmp_path):
    full, batch = hand_full(), hand_batch()
    (tmp_path / FULL_NAME).write_bytes(full)
    (tmp_path / DIFF_NAME).write_bytes(batch)
    (tmp_path / "MANIFEST.json").write_bytes(hand_manifest(full, batch))
    out = tmp_path / "out.pt"
    assert recovery.export(str(tmp_path), str(out)) == 1
    state = torch.load(out, weights_only=True)
    v = torch.zeros(10)
    v[INDICES_V] = torch.tensor(SPARSE_V)
    assert torch.equal(state["model"]["w"], torch.tensor(W) - 0.5 * torch.tensor(GRAD_W))
    assert torch.equal(state["model"]["v"], -0.5 * v)
    assert state["model"]["w"].tolist() == [0.875, 2.125]       # as docs/format.md says
    assert state["model"]["v"][3].item() == -0.5 and state["model"]["v"][7].item() == -1.0


def test_lowdiff_writes_the_bytes_the_spec_describes(tmp_path):
    written = lowdiff_writes_every_kind(tmp_path)
    full, batch = hand_full(), hand_batch()
    assert written[FULL_NAME] == full
    assert written[DIFF_NAME] == batch
    assert written["full-share.ldf"] == hand_full_share()
    assert written["diff-share.ldd"] == hand_diff_share()
    assert written["MANIFEST.json"] == hand_manifest(full, batch)
    assert written["CONTROLLER.json"] == hand_controller()
    assert written["TIERS.json"] == hand_tiers(str(tmp_path / "shared"))
    assert written[BUCKET_MANIFEST] == hand_bucket_manifest(full, batch)
    assert written["DRIVE.json"] == hand_drive(str(tmp_path / "nvme1" / "rank-00001"))


def test_the_hand_built_shares_and_sidecars_are_read_by_lowdiff(tmp_path):
    (tmp_path / "full-share.ldf").write_bytes(hand_full_share())
    (tmp_path / "diff-share.ldd").write_bytes(hand_diff_share())
    (tmp_path / "CONTROLLER.json").write_bytes(hand_controller())
    (tmp_path / "TIERS.json").write_bytes(hand_tiers("/shared/tier"))
    with fastio.Reader(str(tmp_path / "full-share.ldf")) as reader:
        share = read_full_share_index(str(tmp_path / "full-share.ldf"), reader)
    assert (share.step, share.index, share.count, share.start, share.end) == (0, 0, 1, 0, 4096)
    assert [p.key for p in share.pieces] == ["/model/w"] and [t.key for t in share.tensors] == ["/rng/x"]
    diff = read_diff_share_index(str(tmp_path / "diff-share.ldd"))
    assert (diff.batch.first, diff.batch.last, diff.index, diff.count, diff.slots) == (1, 1, 0, 1, (0, 1))
    assert read_state(str(tmp_path)) == (SAMPLES, SETTINGS)
    marker = read_tiers(str(tmp_path))
    assert marker is not None and (marker.shared_dir, marker.local_policy, marker.max_lag_steps) == \
        ("/shared/tier", "keep-last 3", 500)
    assert read_marker(str(tmp_path)) == json.loads(hand_tiers("/shared/tier"))
    full, batch = hand_full(), hand_batch()
    commit = BucketManifest.from_json(hand_bucket_manifest(full, batch), BUCKET_MANIFEST, Manifest)
    assert commit.seq == 0 and commit.objects == {FULL_NAME: (len(full), crc32c(full)),
                                                  DIFF_NAME: (len(batch), crc32c(batch))}
    assert commit.manifest.files() == {FULL_NAME, DIFF_NAME}
    (tmp_path / "nvme1" / "rank-00003").mkdir(parents=True)
    (tmp_path / "rank-00003").mkdir()
    (tmp_path / "rank-00003" / "DRIVE.json").write_bytes(hand_drive(str(tmp_path / "nvme1" / "rank-00003")))
    assert rank_directory(str(tmp_path), 3) == str(tmp_path / "nvme1" / "rank-00003")


def doc_text() -> str:
    with open(DOC) as f:
        return f.read()


def hex_of(text: str) -> bytes:
    return bytes.fromhex(re.sub(r"\s", "", text))


def test_the_worked_example_in_format_md_matches(tmp_path):
    """The numbers and bytes docs/format.md quotes for the example are those of the files lowdiff writes."""
    doc = doc_text()
    example = doc[doc.index("## A worked example"):doc.index("## Manifest")]
    written = lowdiff_writes_every_kind(tmp_path)
    full, batch = written[FULL_NAME], written[DIFF_NAME]
    assert f"({len(full)} bytes)" in example
    assert full[:16].hex() in example and batch[:16].hex() in example
    record = batch[RECORD_OFFSET:]
    quoted = dict(re.findall(r"(header is|dense gradient \(|sparse values \(|indices 3 and 7:)\s*`([0-9a-f ]+)`",
                             example))
    assert record[:16] == hex_of(quoted["header is"])
    packed_len, raw_len = struct.unpack_from("<IQ", record, 16)
    assert f"at file offset {RECORD_OFFSET + 32 + packed_len};" in example
    skippable = record[32 + packed_len - 15:32 + packed_len]
    assert skippable[:8].hex() == "502a4d1807000000" and "`502a4d18 07000000` and 7 zero" in example
    assert f32(W).hex() in example
    raw = record[32 + packed_len:32 + packed_len + raw_len]
    assert raw[:8] == hex_of(quoted["dense gradient ("])
    assert raw[8:] == hex_of(quoted["sparse values ("])
    unpacked = zstandard.ZstdDecompressor().decompressobj().decompress(record[32:32 + packed_len])
    assert unpacked[-4:] == hex_of(quoted["indices 3 and 7:"])


NESTED = ("share", "manifest", "settings", "bucket_manifest")   # objects whose fields the table lists as `a.b`


def fields_of(body: dict) -> list:
    return [f"{key}.{sub}" if key in NESTED else key
            for key, value in body.items() for sub in (value if key in NESTED else [None])]


def test_format_md_lists_every_field_kind_and_version_lowdiff_writes(tmp_path):
    """docs/format.md's table of fields is held to the code: each file's container kind, index kind,
    version and set of fields are those of the file lowdiff writes."""
    doc = doc_text()
    section = doc[doc.index("## Fields of every file"):doc.index("## Container")]
    rows = re.findall(r"^\| (.+?) \| (\d+|-) \| (\"[a-z-]+\"|-) \| (\d+) \| (.+?) \|$", section, re.M)
    written = lowdiff_writes_every_kind(tmp_path)
    files = {"full checkpoint": FULL_NAME, "differential batch": DIFF_NAME, "full-checkpoint share": "full-share.ldf",
             "differential share": "diff-share.ldd", "`MANIFEST.json`": "MANIFEST.json",
             "`CONTROLLER.json`": "CONTROLLER.json", "`TIERS.json`": "TIERS.json", "`DRIVE.json`": "DRIVE.json",
             "bucket `MANIFEST-N.json`": BUCKET_MANIFEST}
    assert sorted(row[0] for row in rows) == sorted(files)
    # A file kind with optional fields is also written as a run that writes them does.
    with_optional = {"full-checkpoint share": "full-share-dtensors.ldf",
                     "differential share": "diff-share-dtensors.ldd"}
    for name, kind, index_kind, version, listed in rows:
        data = written[files[name]]
        listed, _, optional_listed = listed.partition("; optional:")
        fields, optional = (re.findall(r"`([a-z_0-9.]+)`", text) for text in (listed, optional_listed))
        if optional or name in with_optional:
            index = container.read_index(name, lambda offset, n, d=written[with_optional[name]]: d[offset:offset + n],
                                         len(written[with_optional[name]]), int(kind))
            assert sorted(fields + optional) == sorted(fields_of(index)), name
        if kind == "-":
            body = json.loads(data)
            assert sorted(fields) == sorted(fields_of(body)), name
            assert (body.get("manifest") or body.get("bucket_manifest") or body)["version"] == int(version), name
            continue
        kind_number = int(kind)
        assert container.KIND_NAMES[kind_number] == name and data[:16] == container.preamble_bytes(kind_number)
        assert container.MAGIC in data[:8] and data.endswith(container.TRAILER_MAGIC)
        index = container.read_index(name, lambda offset, n, data=data: data[offset:offset + n], len(data), kind_number)
        assert (index["version"], json.dumps(index["kind"])) == (FORMAT_VERSION, index_kind) == \
            (int(version), index_kind), name
        assert sorted(fields) == sorted(fields_of(index)), name
    example = json.loads(re.search(r"## Manifest.*?```json\n(.*?)```", doc, re.S).group(1))["manifest"]
    for key, entry in (("fulls", FullEntry), ("batches", BatchEntry), ("retired", RetiredEntry)):
        assert list(example[key][0]) == [f.name for f in dataclasses.fields(entry)], key
    assert sorted(example) == sorted(json.loads(written["MANIFEST.json"])["manifest"])
    assert f'magic "{container.MAGIC[:-1].decode()}\\0" (8) | version u16 = {FORMAT_VERSION}' in doc
    assert f'magic "{container.TRAILER_MAGIC[:-1].decode()}\\0" (8)' in doc
    kinds = re.search(r"kind: (1 = .+)", doc)
    assert kinds is not None and kinds.group(1) == ", ".join(f"{k} = {v}" for k, v in container.KIND_NAMES.items())


def test_a_full_checkpoint_and_its_shares_declare_their_common_fields_once():
    from lowdiff.format.schema import FullIndex, FullMeta
    common = [f.name for f in dataclasses.fields(FullMeta)]
    for cls in (FullIndex, FullShareIndex):
        assert issubclass(cls, FullMeta) and [f.name for f in dataclasses.fields(cls)][:len(common)] == common
    objects = Section(8192, 10, 0)
    full = FullIndex(3, SESSION, RUN, 4096, (), objects, ("w",), {"w": 0}, "SGD", "Dense()")
    assert (full.step, full.payload_bytes, full.compressor) == (3, 4096, "Dense()")
    assert dataclasses.replace(full, step=4).to_json() == {**full.to_json(), "step": 4}
    share = FullShareIndex(3, SESSION, RUN, 0, 1, 0, (), (), 0, (), objects, ("w",), {"w": 0}, "SGD", "Dense()")
    assert share.to_json()["version"] == full.to_json()["version"] == FORMAT_VERSION
    assert {k: v for k, v in share.to_json().items() if k in full.to_json() and k != "kind"} == \
        {k: v for k, v in full.to_json().items() if k not in ("kind", "payload_bytes")}
