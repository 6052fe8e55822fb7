"""The small-object encoding: exact round trips of every supported shape, a safe fallback for
what JSON cannot express, and clear errors for damaged input."""
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lowdiff.errors import CorruptCheckpointError
from lowdiff.format import tree

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=8))
keys = st.one_of(st.text(max_size=4), st.integers(-5, 5), st.sampled_from(["t", "d", "x", "b"]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.tuples(inner, inner), st.dictionaries(keys, inner, max_size=4)), max_leaves=20)


def same(a, b):
    assert type(a) is type(b), (a, b)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


@given(values)
def test_round_trip_is_exact_for_nested_values(value):
    data = tree.dumps(value)
    assert data[:1] == b"J"
    same(tree.loads(data, "f"), value)


@pytest.mark.parametrize("tensor", [torch.tensor(0.5), torch.arange(6, dtype=torch.int64).view(2, 3),
                                    torch.ones(3, dtype=torch.bfloat16), torch.empty(0, 4),
                                    torch.tensor([True, False]), torch.arange(10.0)[::2]])
def test_tensors_round_trip_bit_for_bit(tensor):
    value = {"a": tensor, "b": (tensor, [tensor]), "nan": float("nan"), "inf": -float("inf"), "raw": b"\x00\xff"}
    out = tree.loads(tree.dumps(value), "f")
    same(out["a"], tensor.contiguous())
    assert math.isnan(out["nan"]) and out["inf"] == -float("inf") and out["raw"] == b"\x00\xff"


class Custom:
    pass


def test_unsupported_values_fall_back_to_torch_save_and_load_safely():
    data = tree.dumps({"obj": Custom()})
    assert data[:1] == b"T"
    with pytest.raises(CorruptCheckpointError, match="cannot load stored objects"):
        tree.loads(data, "ckpt/x")  # weights_only refuses the unknown class: no code runs


@pytest.mark.parametrize("cut", [0, 1, 3, 10, -1])
def test_damaged_bytes_raise_naming_the_file(cut):
    data = tree.dumps({"t": torch.arange(100), "k": [1, 2]})
    with pytest.raises(CorruptCheckpointError, match="ckpt/f.ldd"):
        tree.loads(data[:cut], "ckpt/f.ldd")
