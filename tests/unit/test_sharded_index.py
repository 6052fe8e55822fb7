"""The chunk entries of sharded (DTensor) state in share indexes (docs/format.md, "Sharded state"):
written only when there are DTensors (other shares keep their bytes), read back as written, and a
malformed entry refused with an error naming the file and the problem."""
import json

import pytest

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format.schema import Section, TensorEntry
from lowdiff.format.sharefile import DiffShareIndex, FullShareIndex

CHUNK = {"global_shape": [5, 4], "mesh_shape": [2], "mesh_dim_names": None, "placements": ["S0"],
         "offsets": [3, 0], "shape": [2, 4]}


def full_share(dtensors):
    tensor = TensorEntry(4096, 32, 7, key="/model/w", dtype="float32", shape=(2, 4))
    return FullShareIndex(4, "ab" * 4, "cd" * 8, 1, 2, 0, (), (), 4096, (tensor,), Section(8192, 10, 9), ("w",),
                          {"w": 0}, "torch.optim.adamw.AdamW", "Dense()", dtensors)


def reread(index, **change):
    obj = json.loads(json.dumps(index.to_json()))
    if change:
        obj["dtensors"] = {"/model/w": {**obj["dtensors"]["/model/w"], **change}}
    return FullShareIndex.from_json("rank-00001/full.ldf", obj, 9000)


def test_chunk_entries_are_written_only_for_sharded_state_and_read_back():
    assert "dtensors" not in full_share(None).to_json()   # unsharded shares: not one byte more
    assert reread(full_share(None)).dtensors == {}
    assert reread(full_share({"/model/w": CHUNK})).dtensors == {"/model/w": CHUNK}
    fields = DiffShareIndex.share_json(1, 2, [0, 1], {1: CHUNK})
    assert fields["dtensors"] == [[1, CHUNK]] and "dtensors" not in DiffShareIndex.share_json(1, 2, [0, 1])
    obj = {"version": 1, "session": "ab" * 4, "run": "cd" * 8, "first": 1, "last": 1, "records": [[1, 16, 10]],
           **json.loads(json.dumps(fields))}
    assert DiffShareIndex.from_json("rank-00001/diff.ldd", obj, 26).dtensors == {1: CHUNK}


@pytest.mark.parametrize("change,words", [
    ({"placements": ["P"]}, "placements ['P']"),
    ({"placements": ["S2"]}, "placements ['S2']"),
    ({"offsets": [4, 0]}, "does not lie in a tensor of shape [5, 4]"),
    ({"shape": [3, 4], "offsets": [2, 0]}, "has shape [3, 4], its tensor [2, 4]"),
    ({"mesh_dim_names": ["a", "b"]}, "not one name per mesh dimension"),
    ({"global_shape": "5x4"}, "needs lists of sizes"),
])
def test_a_malformed_chunk_entry_is_refused_naming_the_file(change, words):
    with pytest.raises(CorruptCheckpointError) as caught:
        reread(full_share({"/model/w": CHUNK}), **change)
    assert "rank-00001/full.ldf" in str(caught.value) and words in str(caught.value), str(caught.value)


def test_chunk_entries_must_name_own_tensors_and_own_slots():
    obj = json.loads(json.dumps(full_share({"/model/w": CHUNK}).to_json()))
    obj["dtensors"] = {"/model/v": CHUNK}
    with pytest.raises(CorruptCheckpointError, match="names '/model/v', which is not one of its own tensors"):
        FullShareIndex.from_json("rank-00001/full.ldf", obj, 9000)
    fields = DiffShareIndex.share_json(1, 2, [0], {3: CHUNK})
    obj = {"version": 1, "session": "ab" * 4, "run": "cd" * 8, "first": 1, "last": 1, "records": [[1, 16, 10]],
           **json.loads(json.dumps(fields))}
    with pytest.raises(CorruptCheckpointError, match="is not \\[slot of this share, chunk entry\\]"):
        DiffShareIndex.from_json("rank-00001/diff.ldd", obj, 26)
