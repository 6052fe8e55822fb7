"""Where a differential batch is, in a striped directory's manifest (docs/format.md, "Differential
batches on the drives"): the entry's ``dir``, written only when set, checked when read; the
devices taken in turn."""
from __future__ import annotations

import json

import pytest

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format.container import BatchEntry, ManifestRecord, RetiredEntry
from lowdiff.store.manifest import entry_path
from lowdiff.store.stripes import StripeDevices

NAME = "diff-000000000001-000000000002-0a1b2c3d.ldd"


def test_an_entry_in_the_directory_itself_keeps_its_bytes():
    record = ManifestRecord([], [BatchEntry(1, 2, NAME, 10, "0a1b2c3d")], "0123456789abcdef",
                            [RetiredEntry(NAME, 10)])
    body = json.loads(record.to_json())["manifest"]
    assert body["batches"] == [{"first": 1, "last": 2, "file": NAME, "nbytes": 10, "session": "0a1b2c3d"}]
    assert body["retired"] == [{"file": NAME, "nbytes": 10}]


def test_an_entry_on_a_drive_round_trips_and_names_its_path():
    entry = BatchEntry(1, 2, NAME, 10, "0a1b2c3d", "/mnt/nvme1/ckpt")
    record = ManifestRecord([], [entry], None, [RetiredEntry(NAME, 10, (), "/mnt/nvme1/ckpt")])
    back = ManifestRecord.from_json(record.to_json(), "MANIFEST.json")
    assert back.batches == [entry] and back.retired[0].dir == "/mnt/nvme1/ckpt"
    assert entry_path("/ckpt", entry) == f"/mnt/nvme1/ckpt/{NAME}"
    assert entry_path("/ckpt", BatchEntry(1, 2, NAME, 10, "0a1b2c3d")) == f"/ckpt/{NAME}"


@pytest.mark.parametrize("where", ["nvme1/ckpt", 7, ["/mnt"]])
def test_a_dir_that_is_not_an_absolute_path_is_damage_naming_the_manifest(where):
    record = ManifestRecord([], [BatchEntry(1, 2, NAME, 10, "0a1b2c3d", "/mnt/nvme1")], None, [])
    body = json.loads(record.to_json())
    body["manifest"]["batches"][0]["dir"] = where
    import zlib

    from lowdiff.format.container import encode_json_file
    body["crc32"] = zlib.crc32(encode_json_file(body["manifest"]))
    with pytest.raises(CorruptCheckpointError, match="MANIFEST.json"):
        ManifestRecord.from_json(encode_json_file(body), "MANIFEST.json")


def test_batches_take_the_devices_in_turn(tmp_path):
    devices = StripeDevices(str(tmp_path / "d0"), (str(tmp_path / "d1"), str(tmp_path / "d2")))
    try:
        assert [devices.batch_directory() for _ in range(7)] == \
            [str(tmp_path / f"d{i % 3}") for i in range(7)]
    finally:
        devices.close()
