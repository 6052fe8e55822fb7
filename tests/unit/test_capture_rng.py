"""RNG states as records and checkpoints hold them: Python's generator state as an int64 tensor
(and, in files written before that, as a list of ints), restored exactly either way."""
import random

import numpy as np
import pytest
import torch

from lowdiff.capture.betweensteps import changed_rng_sources
from lowdiff.format import tree
from lowdiff.step import boundary as capture


def draws():
    return [random.random() for _ in range(3)], np.random.rand(3).tolist(), torch.rand(3).tolist()


def test_python_state_is_captured_as_an_int64_tensor_of_its_625_ints():
    random.seed(7)
    random.random()
    version, internal, gauss = capture.capture_rng()["python"]
    assert isinstance(internal, torch.Tensor) and internal.dtype == torch.int64 and internal.numel() == 625
    assert (version, tuple(internal.tolist()), gauss) == random.getstate()


@pytest.mark.parametrize("stored_as", ["tensor", "list (files before the tensor)"])
def test_a_stored_state_restores_every_generator_exactly(stored_as):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)   # leaves a cached gauss value in Python's state
    state = tree.loads(tree.dumps(capture.capture_rng()), "rng")
    if stored_as != "tensor":
        version, internal, gauss = state["python"]
        state["python"] = [version, internal.tolist(), gauss]   # what older files decode to
    expected = draws()
    random.seed(99)
    np.random.seed(99)
    torch.manual_seed(99)
    capture.restore_rng(state)
    assert draws() == expected


def test_the_between_steps_check_sees_a_python_draw_with_either_form():
    state = capture.capture_rng()
    assert changed_rng_sources(state) == set()
    old_form = {**state, "python": (state["python"][0], state["python"][1].tolist(), state["python"][2])}
    assert changed_rng_sources(old_form) == set()
    random.random()
    assert changed_rng_sources(state) == {"python random"}
    assert changed_rng_sources(old_form) == {"python random"}


def test_a_record_of_the_rng_state_is_small_binary_not_625_json_numbers():
    encoded = tree.dumps(capture.capture_rng())
    start = len(tree._JSON_FORMAT) + tree._HEAD.size
    (length,) = tree._HEAD.unpack_from(encoded, len(tree._JSON_FORMAT))
    skeleton = encoded[start:start + length]
    assert skeleton.count(b",") < 50, f"the Python state's ints went into the JSON: {len(skeleton)} bytes"


@pytest.mark.parametrize("path", ["state struct read directly", "np.random.get_state fallback"])
def test_the_between_steps_check_sees_numpy_draws_and_reseeds(path, monkeypatch):
    """The check reads numpy's MT19937 state from its ctypes address (its layout confirmed once
    against np.random.get_state); where that cannot be done it falls back to get_state."""
    if path.startswith("np.random"):
        monkeypatch.setattr(capture, "_mt_layout_checked", False)
    else:
        assert capture._mt19937_state() is not None, "numpy's MT19937 layout no longer matches"
    np.random.seed(11)
    state = capture.capture_rng()
    assert changed_rng_sources(state) == set()
    np.random.rand()
    assert changed_rng_sources(state) == {"numpy"}
    np.random.seed(11)
    assert changed_rng_sources(state) == set()
    np.random.seed(12)
    assert changed_rng_sources(state) == {"numpy"}
    np.random.set_state((state["numpy"][0], state["numpy"][1].numpy().astype(np.uint32), *state["numpy"][2:]))
    assert changed_rng_sources(state) == set()


def test_the_direct_read_of_numpys_state_is_its_key_and_position():
    np.random.seed(5)
    np.random.rand(700)   # past one refill of the 624 words
    raw = capture._mt19937_state()
    _, keys, pos, _, _ = np.random.get_state(legacy=True)
    assert np.array_equal(np.frombuffer(raw, np.uint32, 624), keys)
    assert int.from_bytes(raw[2496:2500], "little", signed=True) == pos
