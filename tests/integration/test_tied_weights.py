"""Tied weights: a language model whose output layer is its input embedding (one parameter under two
state-dict names). A full checkpoint stores that memory once and names it from both places; resume
reads it into the one live parameter (the tie survives) and equals the uninterrupted run byte for
byte, Dense and TopK; training on from there equals it too. ``tree.split_tensors`` joins exactly the
tensors that are one memory, and nothing else."""
from __future__ import annotations

import os

import pytest
import torch

import lowdiff
import recovery
from lowdiff.format import tree
from lowdiff.format.fullckpt import read_full_index
from lowdiff.store.manifest import read_manifest

VOCAB, WIDTH, STEPS = 48, 32, 12


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.mix = torch.nn.Linear(WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight          # tied, as GPT-2 ties wte and lm_head

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def train(directory, compressor, steps, seed=0):
    torch.manual_seed(seed)
    model = TinyLM()
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, directory, compressor=compressor,
                       full_every=4, batch_steps=2)
    step = recovery.resume(directory, model, opt)
    while step < steps:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (4, 6), generator=g)
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(1, dims=1).reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        step += 1
    opt.close()
    return model, opt.optimizer, step


def same_state(a_model, a_opt, b_model, b_opt):
    for (name, x), (_, y) in zip(a_model.state_dict().items(), b_model.state_dict().items(), strict=True):
        assert torch.equal(x, y), name
    for key, state in a_opt.state_dict()["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b_opt.state_dict()["state"][key][name]), (key, name)


def full_checkpoint_paths(directory):
    return [os.path.join(directory, f.file) for f in read_manifest(str(directory)).fulls]


@pytest.mark.parametrize("compressor", [lowdiff.Dense(), lowdiff.TopK(0.25, min_numel=16)], ids=["dense", "topk"])
def test_tied_weight_stored_once_and_resumed_exactly(tmp_path, compressor):
    want_model, want_opt, _ = train(tmp_path / "ref", compressor, STEPS)
    train(tmp_path / "ckpt", compressor, 7)                       # stops after step 7: a full at 4, 3 records

    fulls = full_checkpoint_paths(tmp_path / "ckpt")
    assert fulls
    for path in fulls:
        index = read_full_index(path)
        keys = {entry.key for entry in index.tensors}
        assert "/model/embed.weight" in keys and "/model/head.weight" not in keys, sorted(keys)
        assert sum(e.nbytes for e in index.tensors if e.key.startswith("/model/")) == \
            sum(p.numel() * 4 for p in TinyLM().parameters())   # each parameter's bytes once

    torch.manual_seed(1)                                          # other initial weights
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert recovery.resume(tmp_path / "ckpt", model, opt) == 7
    assert model.head.weight is model.embed.weight                # the tie survives the load
    half_model, half_opt, _ = train(tmp_path / "half", compressor, 7)
    same_state(model, opt, half_model, half_opt)

    got_model, got_opt, step = train(tmp_path / "ckpt", compressor, STEPS)   # resumes at 7, trains on
    assert step == STEPS
    same_state(got_model, got_opt, want_model, want_opt)


def test_files_that_store_a_tied_weight_under_each_name_still_resume_exactly(tmp_path, monkeypatch):
    """Checkpoints written before tied weights were joined hold the weight under both names."""
    want_model, want_opt, _ = train(tmp_path / "ref", lowdiff.Dense(), 6)
    with monkeypatch.context() as patch:
        patch.setattr(tree, "same_memory", lambda tensor: None)      # the writer of before
        train(tmp_path / "ckpt", lowdiff.Dense(), 6)
    keys = {entry.key for entry in read_full_index(full_checkpoint_paths(tmp_path / "ckpt")[-1]).tensors}
    assert {"/model/embed.weight", "/model/head.weight"} <= keys
    torch.manual_seed(1)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert recovery.resume(tmp_path / "ckpt", model, opt) == 6
    assert model.head.weight is model.embed.weight
    same_state(model, opt, want_model, want_opt)


def test_split_tensors_joins_exactly_the_same_memory():
    base = torch.arange(64, dtype=torch.float32)
    param = torch.nn.Parameter(torch.ones(4, 4))
    state = {"a": param.detach(), "b": param.detach(),          # one memory under two names (tied)
             "view": base[:16], "shifted": base[1:17],           # same storage, other start: apart
             "reshaped": base[:16].view(4, 4), "again": base[:16],  # same start, other shape; same again
             "bits": base[:16].view(torch.int32),                # same bytes, other dtype: apart
             "e1": torch.empty(0), "e2": torch.empty(0)}         # empty tensors are never joined
    skeleton, tensors = tree.split_tensors(state, "/s")
    keys = [key for key, _ in tensors]
    assert keys == ["/s/a", "/s/view", "/s/shifted", "/s/reshaped", "/s/bits", "/s/e1", "/s/e2"]
    assert skeleton["b"] == skeleton["a"] and skeleton["again"] == skeleton["view"]
    stored = dict(tensors)
    joined = tree.join_tensors(skeleton, stored.__getitem__)
    assert joined["b"] is joined["a"] and joined["again"] is joined["view"]
    assert all(torch.equal(joined[k], state[k]) for k in state)
