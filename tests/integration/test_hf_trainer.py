"""Hugging Face Trainer with LowDiffCallback: a run stopped after k steps and resumed by a new
Trainer equals the uninterrupted run byte for byte — model, optimizer, the scheduler Trainer steps
itself, RNG, Trainer's global step and epoch, and the batches it sees (mid-epoch, at an epoch's
end, twice in a row) — and after a real SIGKILL of the training process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import lowdiff  # noqa: E402
from lowdiff.integrations.hf import LowDiffCallback  # noqa: E402

SAMPLES, BATCH, TOTAL = 20, 4, 13          # 5 steps per epoch, into a third epoch


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (SAMPLES, 8), generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def collate(items):
    return {key: torch.stack([item[key] for item in items]) for key in ("input_ids", "labels")}


def note_batches(model, seen):
    """Note the samples of each batch the model trains on (the data order Trainer fed it; the
    dataloader itself fetches a batch ahead)."""
    rows = {tuple(row.tolist()): i for i, row in enumerate(Tokens().ids)}

    def hook(module, args, kwargs):
        if module.training:
            seen.extend(rows[tuple(row.tolist())] for row in kwargs["input_ids"])
    model.register_forward_pre_hook(hook, with_kwargs=True)


class StopAt(transformers.TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def run(tmp_path, directory, stop, compressor=None):
    """Train to step ``stop`` with a fresh Trainer, resuming what ``directory`` holds."""
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)        # dropout on: the RNG matters
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=TOTAL, seed=0,
        save_strategy="no", report_to=[], logging_steps=1000, use_cpu=True, disable_tqdm=True)
    callback = LowDiffCallback(directory, compressor=compressor, full_every=4, batch_steps=2)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = transformers.get_linear_schedule_with_warmup(inner, num_warmup_steps=3, num_training_steps=TOTAL)
    opt = callback.wrap(inner, model, scheduler=sched)
    seen: list[int] = []
    note_batches(model, seen)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), data_collator=collate,
                                   optimizers=(opt, sched), callbacks=[callback, StopAt(stop)])
    trainer.train(resume_from_checkpoint=callback.resume(trainer))
    opt.close()
    return {"seen": seen, "model": [t.clone() for t in model.state_dict().values()],
            "optimizer": inner.state_dict(), "scheduler": sched.state_dict(), "rng": torch.get_rng_state(),
            "step": trainer.state.global_step, "epoch": trainer.state.epoch}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted runs, by compressor."""
    cache = {}

    def get(compressor=None):
        key = repr(compressor)
        if key not in cache:
            tmp = tmp_path_factory.mktemp("ref")
            cache[key] = run(tmp, str(tmp / "ckpt"), TOTAL, compressor)
        return cache[key]
    return get


def same(a, b):
    assert a["step"] == b["step"] and a["epoch"] == b["epoch"]
    assert a["scheduler"] == b["scheduler"]
    assert torch.equal(a["rng"], b["rng"])
    assert all(torch.equal(x, y) for x, y in zip(a["model"], b["model"], strict=True))
    for key, state in a["optimizer"]["state"].items():
        other = b["optimizer"]["state"][key]
        assert all(torch.equal(state[name], other[name]) for name in state)
    return True


@pytest.mark.parametrize("stops", [[3], [5], [2, 8]], ids=["mid-epoch", "epoch-end", "twice"])
def test_a_new_trainer_resumes_exactly(tmp_path, reference, stops):
    want = reference()
    seen = []
    directory = str(tmp_path / "ckpt")
    for stop in stops:
        part = run(tmp_path, directory, stop)
        assert part["step"] == stop
        seen += part["seen"]
    got = run(tmp_path, directory, TOTAL)
    assert seen + got["seen"] == want["seen"]
    assert same(got, want)


def test_topk_resumes_exactly_at_a_full_checkpoint(tmp_path, reference):
    # TopK residuals are restored exactly at a full checkpoint's step (full_every=4)
    want = reference(lowdiff.TopK(0.3, min_numel=512))
    first = run(tmp_path, str(tmp_path / "ckpt"), 8, lowdiff.TopK(0.3, min_numel=512))
    got = run(tmp_path, str(tmp_path / "ckpt"), TOTAL, lowdiff.TopK(0.3, min_numel=512))
    assert first["seen"] + got["seen"] == want["seen"]
    assert same(got, want)


def test_wrap_options_the_callback_owns_are_refused():
    with pytest.raises(TypeError, match="boundary"):
        LowDiffCallback("x", boundary="step")


TRAINER = """
import sys, pathlib
sys.path.insert(0, {tests!r})
from test_hf_trainer import run, TOTAL
run(pathlib.Path({tmp!r}), {directory!r}, TOTAL)
"""


def test_sigkill_then_a_new_trainer_resumes_exactly(tmp_path, reference):
    want = reference()
    directory = str(tmp_path / "ckpt")
    script = TRAINER.format(tests=os.path.dirname(__file__), tmp=str(tmp_path / "killed"), directory=directory)
    env = {**os.environ, "LOWDIFF_FAULT": "batch-commit:3"}     # SIGKILLs itself at the 3rd batch commit
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    got = run(tmp_path, directory, TOTAL)
    assert 0 < len(got["seen"]) < len(want["seen"])
    assert want["seen"][-len(got["seen"]):] == got["seen"]
    assert same(got, want)
