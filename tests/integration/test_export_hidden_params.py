"""Export and resume of a model whose state_dict() does not hand out a trained parameter under its own
name: a state-dict hook replaces it by other tensors, as torchtitan's llama3 FusedQKVLinear saves its
fused ``wqkv`` as ``wq``/``wk``/``wv`` (issue #31; docs/format.md, "Parameters the model's
state_dict() does not hand out"). Plain torch, one process: the torchtitan run itself is in
tests/distributed/test_torchtitan.py."""
from __future__ import annotations

import copy
import logging

import pytest
import torch

import lowdiff
import recovery
from lowdiff.capture import stepcapture
from lowdiff.errors import CheckpointError

STEPS = 10


class FusedPair(torch.nn.Module):
    """Trains one fused weight ``qk`` (rows of q and k interleaved); its state_dict() holds ``q`` and
    ``k`` instead (copies, as torchtitan's split), and load_state_dict() joins them back."""

    def __init__(self):
        super().__init__()
        self.qk = torch.nn.Parameter(torch.randn(8, 4))
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._join)

    def forward(self, x):
        return x @ self.qk.t()

    @staticmethod
    def _split(module, state, prefix, local_metadata):
        fused = state.pop(f"{prefix}qk")
        state[f"{prefix}q"] = fused[0::2].contiguous()
        state[f"{prefix}k"] = fused[1::2].contiguous()

    @staticmethod
    def _join(module, state, prefix, *args):
        if f"{prefix}q" in state and f"{prefix}k" in state:
            q, k = state.pop(f"{prefix}q"), state.pop(f"{prefix}k")
            state[f"{prefix}qk"] = torch.stack([q, k], dim=1).reshape(-1, q.shape[1])


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), FusedPair(), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def state_of(model, opt) -> dict:
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "optimizer": copy.deepcopy(opt.state_dict()["state"])}


def train(directory, *, compressor=None) -> dict:
    """STEPS steps with a full checkpoint every 4 (steps 8..10 only in differentials): {step: state}."""
    model, opt = build()
    opt = lowdiff.wrap(opt, model, str(directory), compressor=compressor or lowdiff.Dense(), full_every=4,
                       batch_steps=2)
    states = {0: state_of(model, opt.optimizer)}
    gen = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        x = torch.randn(5, 6, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        states[step] = state_of(model, opt.optimizer)
    opt.close()
    return states


def assert_exported(exported: dict, want: dict, full_step: bool):
    # Parameters under their own names (the fused one too), buffers; the hook's q and k only at a
    # full checkpoint's step (the export cannot make them again at a later one).
    split = {"1.q", "1.k"} if full_step else set()
    assert set(exported["model"]) == set(want["params"]) | set(want["buffers"]) | split
    if full_step:
        assert torch.equal(exported["model"]["1.q"], want["params"]["1.qk"][0::2])
        assert torch.equal(exported["model"]["1.k"], want["params"]["1.qk"][1::2])
    for name, tensor in {**want["params"], **want["buffers"]}.items():
        assert torch.equal(exported["model"][name], tensor), name
    assert set(exported["optimizer"]["state"]) == set(want["optimizer"])
    for slot, entry in want["optimizer"].items():
        for key, value in entry.items():
            assert torch.equal(exported["optimizer"]["state"][slot][key], value), (slot, key)


@pytest.mark.parametrize("step", [4, 7, None])
def test_export_of_a_model_whose_state_dict_hides_a_parameter(tmp_path, step, caplog):
    states = train(tmp_path / "run")
    out = tmp_path / "out.pt"
    with caplog.at_level(logging.WARNING, logger="lowdiff"):
        assert recovery.export(tmp_path / "run", out, step=step) == (step or STEPS)
    left_out = "['1.k', '1.q'] are neither parameters nor buffers (a state_dict hook made them"
    assert (left_out in caplog.text) == (step != 4)
    exported = torch.load(out, weights_only=True)
    assert_exported(exported, states[step or STEPS], full_step=step == 4)
    # What it holds loads into the model as it is (its load hook joins nothing: no q and k).
    model, _ = build()
    model.load_state_dict(exported["model"])
    assert torch.equal(model[1].qk, states[step or STEPS]["params"]["1.qk"])


def test_export_to_dcp_of_such_a_model(tmp_path):
    """The DCP directory holds the fused parameter under its own name (named_parameters()'s), and
    its optimizer state under that name too; not the hook's q and k."""
    import warnings

    import torch.distributed.checkpoint as dcp

    states = train(tmp_path / "run", compressor=lowdiff.TopK(ratio=0.25))
    assert recovery.export(tmp_path / "run", tmp_path / "dcp", step=7, format="dcp") == 7
    want = states[7]
    keys = set(dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata)
    assert "1.qk" in keys and "state.1.qk.exp_avg" in keys and not {"1.q", "1.k"} & keys
    loaded = {name: torch.zeros_like(t) for name, t in want["params"].items()}
    loaded["state.1.qk.exp_avg_sq"] = torch.zeros(8, 4)
    with warnings.catch_warnings():   # the loader's own no_dist warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for name, tensor in want["params"].items():
        assert torch.equal(loaded[name], tensor), name
    # (1.qk is slot 2: after 0.weight and 0.bias)
    assert torch.equal(loaded["state.1.qk.exp_avg_sq"], want["optimizer"][2]["exp_avg_sq"])


def test_resume_of_such_a_model_is_exact(tmp_path):
    states = train(tmp_path / "run")
    for step in (7, None):
        model, opt = build()
        assert recovery.resume(str(tmp_path / "run"), model, opt, step=step) == (step or STEPS)
        got, want = state_of(model, opt), states[step or STEPS]
        for part in ("params", "buffers"):
            for name, tensor in want[part].items():
                assert torch.equal(got[part][name], tensor), (step, name)
        for slot, entry in want["optimizer"].items():
            for key, value in entry.items():
                assert torch.equal(got["optimizer"][slot][key], value), (step, slot, key)


def test_a_directory_written_before_hidden_parameters_were_stored(tmp_path, monkeypatch):
    """Files from before this fix (as the old writer: no hidden parameter stored) still resume, and
    their export is refused naming the parameter and what to do."""
    monkeypatch.setattr(stepcapture, "hidden_parameters", lambda *args: {})
    states = train(tmp_path / "run")
    monkeypatch.undo()
    with pytest.raises(CheckpointError) as refused:   # (each full checkpoint in turn: none can be used)
        recovery.export(tmp_path / "run", tmp_path / "out.pt")
    message = str(refused.value)
    assert "lacks: ['1.qk']" in message and "hooks put ['1.q', '1.k'] in their place" in message
    assert "resume the run with its model and let it take a full checkpoint" in message
    model, opt = build()
    assert recovery.resume(str(tmp_path / "run"), model, opt, step=8) == 8
    assert torch.equal(model[1].qk, states[8]["params"]["1.qk"])
