"""Golden bytes: the worked example of docs/format.md, built by hand from the spec (struct, json,
zlib, a CRC-32C written here, zstd), is read by lowdiff; and lowdiff's own output for the same
inputs is the same bytes. A change to either side that the spec does not describe fails here.
"""
from __future__ import annotations

import json
import os
import re
import struct
import zlib

import torch
import zstandard

import recovery
from lowdiff.format.batchfile import write_batch
from lowdiff.format.fullckpt import Snapshot
from lowdiff.format.records import StepRecord
from lowdiff.step.compress import Compressed
from lowdiff.store.manifest import BatchEntry, FullEntry, Manifest, write_manifest

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
    snapshot = Snapshot()
    state = {"model": {"w": torch.tensor(W), "v": torch.zeros(10)},
             "optimizer": {"state": {}, "param_groups": [sgd_group()]}, "scheduler": None, "extra": {},
             "rng": {}, "residuals": {}, "grad_scaler": None}
    snapshot.stage(0, state, {"param_names": ["w", "v"], "param_aliases": {"w": 0, "v": 1},
                              "optimizer_class": "torch.optim.sgd.SGD", "compressor": "TopK(ratio=0.2)"})
    snapshot.copy(on_training_thread=True)
    full_path = str(tmp_path / FULL_NAME)
    snapshot.persist(full_path, SESSION, run=RUN)
    assert (tmp_path / FULL_NAME).read_bytes() == hand_full()

    record = StepRecord(1, False, [Compressed("dense", 2, torch.tensor(GRAD_W)),
                                   Compressed("sparse", 10, torch.tensor(SPARSE_V),
                                              torch.tensor(INDICES_V, dtype=torch.int32))], record_objects())
    batch_path = str(tmp_path / DIFF_NAME)
    from lowdiff.format.records import encode_record
    write_batch(batch_path, SESSION, [(1, encode_record(record))], run=RUN)
    assert (tmp_path / DIFF_NAME).read_bytes() == hand_batch()

    full, batch = hand_full(), hand_batch()
    write_manifest(str(tmp_path), Manifest([FullEntry(0, FULL_NAME, len(full), SESSION)],
                                           [BatchEntry(1, 1, DIFF_NAME, len(batch), SESSION)], RUN, []))
    assert (tmp_path / "MANIFEST.json").read_bytes() == hand_manifest(full, batch)


def test_the_worked_example_in_format_md_matches(tmp_path):
    """The numbers and bytes docs/format.md quotes for the example are these files'."""
    with open(DOC) as f:
        doc = f.read()
    example = doc[doc.index("## A worked example"):doc.index("## Manifest")]
    full, record = hand_full(), hand_record()
    assert f"({len(full)} bytes)" in example
    assert preamble(1).hex() in example and preamble(2).hex() in example
    assert record[:16].hex() == re.sub(r"\s", "", "4c445243 0100 0000 0100000000000000")
    packed_len = struct.unpack_from("<I", record, 16)[0]
    assert f"at file offset {RECORD_OFFSET + 32 + packed_len};" in example
    skippable = record[32 + packed_len - 15:32 + packed_len]
    assert skippable[:8].hex() == "502a4d1807000000" and "`502a4d18 07000000` and 7 zero" in example
    assert f32(W).hex() in example
    assert re.sub(r"\s", "", "0000803e 000080be") == f32(GRAD_W).hex()
    assert re.sub(r"\s", "", "0000803f 00000040") == f32(SPARSE_V).hex()
    assert re.sub(r"\s", "", "0300 0400") == struct.pack("<2H", 3, 4).hex()
