"""PyTorch Lightning with LowDiffCallback: a fit stopped after k steps and resumed by a new Trainer
(a plain ``trainer.fit(module)``) equals the uninterrupted fit byte for byte — model, optimizer,
the step-interval scheduler Lightning steps, RNG, Lightning's global step and epoch, and the
batches trained (mid-epoch, at an epoch's last batch, twice in a row) — and after a real SIGKILL.
Lightning ends an epoch after len(loader) batches without running the loader to exhaustion, which
a plain for loop does; the epoch-end case checks that the next epoch's order does not depend on it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch")

import lowdiff  # noqa: E402
from lowdiff.integrations.lightning import LowDiffCallback  # noqa: E402

# Lightning's own warnings under torch 2.13 (not ours): a deprecated pytree class, and hints.
pytestmark = [pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning:lightning.*")]

SAMPLES, BATCH, TOTAL = 20, 4, 13          # 5 steps per epoch, into a third epoch


class Module(pl.LightningModule):
    def __init__(self, resumable=True):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        self.seen: list[int] = []
        self.resumable = resumable

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.seen += index.tolist()
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g),
                             torch.arange(SAMPLES))
        loader = DataLoader(data, batch_size=BATCH, shuffle=True)
        return lowdiff.ResumableLoader(loader, seed=3) if self.resumable else loader


class StopAt(pl.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            trainer.should_stop = True


def run(directory, stop, compressor=None, resumable=True):
    module = Module(resumable)
    trainer = pl.Trainer(max_steps=TOTAL, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[LowDiffCallback(directory, compressor=compressor, full_every=4, batch_steps=2),
                                    StopAt(stop)])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(num_workers|does not have many workers).*")
        trainer.fit(module)
    inner = trainer.optimizers[0].optimizer
    return {"seen": module.seen, "model": [t.clone() for t in module.state_dict().values()],
            "optimizer": inner.state_dict(), "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
            "rng": torch.get_rng_state(), "step": trainer.global_step, "epoch": trainer.current_epoch}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(compressor=None):
        if repr(compressor) not in cache:
            cache[repr(compressor)] = run(str(tmp_path_factory.mktemp("ref") / "ckpt"), TOTAL, compressor)
        return cache[repr(compressor)]
    return get


def same(a, b):
    assert (a["step"], a["epoch"]) == (b["step"], b["epoch"])
    assert a["scheduler"] == b["scheduler"]
    assert torch.equal(a["rng"], b["rng"])
    assert all(torch.equal(x, y) for x, y in zip(a["model"], b["model"], strict=True))
    for key, state in a["optimizer"]["state"].items():
        assert all(torch.equal(value, b["optimizer"]["state"][key][name]) for name, value in state.items())
    return True


@pytest.mark.parametrize("stops", [[3], [5], [2, 8]], ids=["mid-epoch", "epoch-end", "twice"])
def test_a_new_trainer_resumes_exactly(tmp_path, reference, stops):
    want = reference()
    seen = []
    for stop in stops:
        part = run(str(tmp_path / "ckpt"), stop)
        assert part["step"] == stop
        seen += part["seen"]
    got = run(str(tmp_path / "ckpt"), TOTAL)
    assert seen + got["seen"] == want["seen"]
    assert same(got, want)


def test_topk_resumes_exactly_at_a_full_checkpoint(tmp_path, reference):
    topk = lowdiff.TopK(0.3, min_numel=16)
    want = reference(topk)
    first = run(str(tmp_path / "ckpt"), 8, topk)
    got = run(str(tmp_path / "ckpt"), TOTAL, topk)
    assert first["seen"] + got["seen"] == want["seen"]
    assert same(got, want)


def test_a_plain_dataloader_is_named_in_a_warning(tmp_path):
    with pytest.warns(RuntimeWarning, match="ResumableLoader"):
        run(str(tmp_path / "ckpt"), 2, resumable=False)


TRAINER = """
import sys
sys.path.insert(0, {tests!r})
from test_lightning import run, TOTAL
run({directory!r}, TOTAL)
"""


def test_sigkill_then_a_new_trainer_resumes_exactly(tmp_path, reference):
    want = reference()
    directory = str(tmp_path / "ckpt")
    script = TRAINER.format(tests=os.path.dirname(__file__), directory=directory)
    env = {**os.environ, "LOWDIFF_FAULT": "batch-commit:3"}     # SIGKILLs itself at the 3rd batch commit
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    got = run(directory, TOTAL)
    assert 0 < len(got["seen"]) < len(want["seen"])
    assert want["seen"][-len(got["seen"]):] == got["seen"]
    assert same(got, want)
