"""An extra_state object whose state_dict() draws from the global RNG (torchdata's StatefulDataLoader
makes its iterator there, and the iterator draws its base seed) does not move the training's RNG
when lowdiff reads it: not at wrap, not at a boundary, not in resume. Before, the uninterrupted run
drew once at wrap and a resumed run once more after the restore, so their RNGs parted (found with
torchtitan's Trainer, issue #31 item 8)."""
import random

import numpy as np
import torch

import lowdiff
import recovery


class DrawingState:
    """Draws from every global generator in state_dict(), as a lazily made iterator does."""

    def __init__(self):
        self.position = 0

    def state_dict(self):
        torch.rand(1)
        random.random()
        np.random.rand()
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


def rng():
    return torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=True)[1].tobytes()


def same(a, b):
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]


def wrapped(directory):
    """(model, wrapped optimizer, the RNG just before wrap())."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    before = rng()
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, directory, compressor=lowdiff.Dense(),
                       full_every=2, batch_steps=1, extra_state={"data": DrawingState()})
    return model, opt, before


def step(model, opt):
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_reading_state_dicts_leaves_the_rng_as_it_was(tmp_path):
    model, opt, before = wrapped(tmp_path / "ckpt")
    assert same(rng(), before)   # wrap read DrawingState.state_dict()
    step(model, opt)             # the forward and SGD draw nothing: every draw here would be lowdiff's
    assert same(rng(), before)
    step(model, opt)
    opt.flush()
    after_two = rng()
    opt.close()

    model, opt, _ = wrapped(tmp_path / "ckpt")
    assert recovery.resume(tmp_path / "ckpt", model, opt) == 2
    assert same(rng(), after_two)   # as restored, though resume read DrawingState.state_dict() again
    opt.close()
