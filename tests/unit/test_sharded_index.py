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


def full_share(dtensors, elsewhere=None):
    tensor = TensorEntry(4096, 32, 7, key="/model/w", dtype="float32", shape=(2, 4))
    return FullShareIndex(4, "ab" * 4, "cd" * 8, 1, 2, 0, (), (), 4096, (tensor,), Section(8192, 10, 9), ("w",),
                          {"w": 0}, "torch.optim.adamw.AdamW", "Dense()", dtensors, elsewhere)


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


HSDP = {**CHUNK, "mesh_shape": [2, 2], "mesh_dim_names": ["replicate", "shard"], "placements": ["R", "S0"]}
LENT = {"/model/v": HSDP}   # a chunk share 0 of the set holds instead of this one (share 1)


def diff_share(fields):
    obj = {"version": 1, "session": "ab" * 4, "run": "cd" * 8, "first": 1, "last": 1, "records": [[1, 16, 10]],
           **json.loads(json.dumps(fields))}
    return DiffShareIndex.from_json("rank-00001/diff.ldd", obj, 26)


def test_chunks_held_by_another_share_are_named_with_it_and_read_back():
    """HSDP (docs/format.md, "2-D meshes"): a chunk another rank of the replicate group writes is
    named in `elsewhere` with its share and dtype, keeps its chunk entry, and is not a tensor of the
    share; a differential share names the slots another share records. Neither field is written
    otherwise."""
    index = full_share({"/model/w": HSDP, **LENT}, {"/model/v": {"share": 0, "dtype": "bfloat16"}})
    back = reread(index)
    assert back.elsewhere == {"/model/v": {"share": 0, "dtype": "bfloat16"}} and back.dtensors["/model/v"] == HSDP
    assert "elsewhere" not in full_share({"/model/w": CHUNK}).to_json()
    fields = DiffShareIndex.share_json(1, 2, [0], {0: HSDP, 1: HSDP}, {1: 0})
    assert fields["elsewhere"] == [[1, 0]] and "elsewhere" not in DiffShareIndex.share_json(1, 2, [0], {0: HSDP})
    back = diff_share(fields)
    assert back.slots == (0,) and back.elsewhere == {1: 0} and back.dtensors == {0: HSDP, 1: HSDP}


@pytest.mark.parametrize("elsewhere,words", [
    ({"/model/v": {"share": 1, "dtype": "float32"}}, "names share 1, not another of the set's 2"),
    ({"/model/v": {"share": 2, "dtype": "float32"}}, "names share 2, not another of the set's 2"),
    ({"/model/v": {"share": 0}}, "dtype"),
    ({"/model/w": {"share": 0, "dtype": "float32"}}, "'/model/w' is one of its own tensors and held elsewhere"),
    ({"/model/v": {"share": 0, "dtype": "float32"}, "/model/u": {"share": 0, "dtype": "float32"}},
     "elsewhere names '/model/u', which has no chunk entry"),
    ({}, "dtensors names '/model/v', which is not one of its own tensors"),
])
def test_a_malformed_elsewhere_is_refused_naming_the_file(elsewhere, words):
    obj = json.loads(json.dumps(full_share({"/model/w": HSDP, **LENT}, {"/model/v": {"share": 0,
                                                                                   "dtype": "float32"}}).to_json()))
    obj["elsewhere"] = elsewhere
    with pytest.raises(CorruptCheckpointError) as caught:
        FullShareIndex.from_json("rank-00001/full.ldf", obj, 9000)
    assert "rank-00001/full.ldf" in str(caught.value) and words in str(caught.value), str(caught.value)


@pytest.mark.parametrize("elsewhere,words", [
    ([[0, 0]], "is not [slot not of this share, another share]"),   # slot 0 is recorded by this share
    ([[1, 1]], "is not [slot not of this share, another share]"),   # share 1 is this one
    ([[1, 5]], "is not [slot not of this share, another share]"),
    ([[2, 0]], "elsewhere names parameter 2, which has no chunk entry"),
    ([[1, 0], [1, 0]], "is not [slot not of this share, another share]"),   # twice
])
def test_a_malformed_differential_elsewhere_is_refused(elsewhere, words):
    # slot 0 is this share's, recorded here; slot 1 only with [1, 0] (this share's is then elsewhere)
    fields = {**DiffShareIndex.share_json(1, 2, [0], {0: HSDP}), "elsewhere": elsewhere}
    with pytest.raises(CorruptCheckpointError) as caught:
        diff_share(fields)
    assert "rank-00001/diff.ldd" in str(caught.value) and words in str(caught.value), str(caught.value)
