"""torchdata's StatefulDataLoader in extra_state, built as the guide's recipe says (torchdata's own
RandomSampler with its own generator, a second generator on the loader, augmentation seeded per
sample): a run stopped mid-epoch, at an epoch's last batch, or twice, and resumed in a new loader,
equals the uninterrupted run — the batches and the model byte for byte — with 0 and 2 workers, and
after a real SIGKILL. Skipped without torchdata.

The recipe avoids two things experiments/stateful_dataloader_roundtrip.py shows: a loader without
``generator=`` draws its workers' base seed from the global RNG when a resumed run first iterates
(after recovery.resume restored that RNG: dropout diverges), and with ``shuffle=True, generator=g``
and no workers the restored shuffle generator misses that base-seed draw, so every later epoch is
shuffled differently (torchdata 0.11)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import Dataset

pytest.importorskip("torchdata.stateful_dataloader")
from lowdiff_helpers import same_tensors, train_on_loader  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402
from torchdata.stateful_dataloader.sampler import RandomSampler  # noqa: E402

import lowdiff  # noqa: E402

# torchdata 0.11 calls a deprecated torch function when a loader is made (its warning, not ours).
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

SAMPLES, BATCH = 24, 4            # 6 batches per epoch


class Augmented(Dataset):
    """(features + an augmentation seeded by the sample's index, target, index)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        noise = torch.randn(6, generator=torch.Generator().manual_seed(1000 + i)) * 0.1
        return self.x[i] + noise, self.y[i], i


def run(directory, workers: int, stop: int, compressor=None):
    """Train to step ``stop`` (resuming what ``directory`` holds): the sample indices seen and the
    final model state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    data = Augmented()
    loader = StatefulDataLoader(data, batch_size=BATCH, num_workers=workers,
                                sampler=RandomSampler(data, generator=torch.Generator().manual_seed(7)),
                                generator=torch.Generator().manual_seed(8))
    return train_on_loader(directory, model, loader, stop, full_every=5, batch_steps=2, compressor=compressor)


same = same_tensors


@pytest.mark.parametrize("workers", [0, 2])
def test_the_recipe_resumes_at_the_exact_next_batch(tmp_path, workers):
    per_epoch = SAMPLES // BATCH
    total = 2 * per_epoch + 3                                   # into a third epoch
    reference, want = run(str(tmp_path / "ref"), workers, total)
    chains = [[2], [per_epoch], [per_epoch - 1, per_epoch + 2]]
    if workers:                                # worker processes are slow to start: one chain of both
        chains = [[per_epoch, per_epoch + 2]]
    for stops in chains:
        directory = str(tmp_path / "-".join(map(str, stops)))
        seen = []
        for stop in stops + [total]:
            part, state = run(directory, workers, stop)
            seen += part
        assert seen == reference, (stops, seen, reference)
        assert same(state, want)


def test_topk_resumes_exactly_across_an_epoch(tmp_path):
    topk = lowdiff.TopK(0.5, min_numel=8)
    reference, want = run(str(tmp_path / "ref"), 0, 14, topk)
    first, _ = run(str(tmp_path / "ckpt"), 0, 4, topk)
    rest, state = run(str(tmp_path / "ckpt"), 0, 14, topk)
    assert first + rest == reference and same(state, want)


TRAINER = """
import sys
sys.path.insert(0, {tests!r})
from test_stateful_dataloader import run
run({directory!r}, 0, 20)
"""


def test_sigkill_then_resume_continues_exactly(tmp_path):
    reference, want = run(str(tmp_path / "ref"), 0, 20)
    directory = str(tmp_path / "ckpt")
    script = TRAINER.format(tests=os.path.dirname(__file__), directory=directory)
    env = {**os.environ, "LOWDIFF_FAULT": "batch-commit:4"}     # SIGKILLs itself at the 4th batch commit
    proc = subprocess.run([sys.executable, "-W", "ignore::UserWarning", "-c", script], env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    seen, state = run(directory, 0, 20)
    assert 0 < len(seen) < len(reference) and reference[-len(seen):] == seen
    assert same(state, want)
