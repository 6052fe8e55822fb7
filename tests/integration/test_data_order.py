"""Data order across a resume: a ResumableLoader in extra_state puts the resumed run on the exact
next batch, for shuffled (with and without a generator), sequential and distributed samplers,
several epochs, mid-epoch and epoch-end interruptions, with and without worker processes; random
augmentation in the dataset is exact with seed_samples. A real SIGKILL as well."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch
from lowdiff_helpers import same_tensors, train_on_loader
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, SequentialSampler

import lowdiff

SAMPLES, BATCH = 40, 4            # 10 batches per epoch


class Indexed(Dataset):
    """(features, target, index): the index tells which sample a batch held; ``noise`` adds a
    random augmentation drawn from the global torch RNG where the sample is computed."""

    def __init__(self, noise: bool = False):
        g = torch.Generator().manual_seed(1)
        self.x, self.y, self.noise = torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g), noise

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        x = self.x[i] + (torch.randn(6) * 0.1 if self.noise else 0)
        return x, self.y[i], i


def make_loader(kind: str, workers: int, noise: bool = False) -> DataLoader:
    data = Indexed(noise)
    options = {"batch_size": BATCH, "num_workers": workers}
    if kind == "shuffle":
        return DataLoader(data, shuffle=True, **options)
    if kind == "shuffle-generator":
        return DataLoader(data, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(7)), **options)
    if kind == "sequential":
        return DataLoader(data, sampler=SequentialSampler(data), **options)
    return DataLoader(data, sampler=DistributedSampler(data, num_replicas=2, rank=1, seed=3), **options)


def run(directory, kind: str, workers: int, stop: int, *, noise=False, compressor=None):
    """Train to step ``stop`` (resuming what ``directory`` holds); the sample indices seen and the
    final state."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    loader = lowdiff.ResumableLoader(make_loader(kind, workers, noise), seed_samples=noise)
    return train_on_loader(directory, model, loader, stop, full_every=7, batch_steps=3, compressor=compressor)


same = same_tensors


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["shuffle", "shuffle-generator", "sequential", "distributed"])
def test_resume_continues_with_the_exact_next_batch(tmp_path, kind, workers):
    per_epoch = SAMPLES // BATCH // (2 if kind == "distributed" else 1)
    total = 2 * per_epoch + 4                        # into a third epoch
    reference, want = run(str(tmp_path / "ref"), kind, workers, total)
    # interrupted mid-epoch; at an epoch's last batch; twice in a row (mid-epoch, then in the next)
    for stops in ([3], [per_epoch], [per_epoch - 2, per_epoch + 3]):
        directory = str(tmp_path / "-".join(map(str, stops)))
        seen = []
        for stop in stops + [total]:
            seen += run(directory, kind, workers, stop)[0]
        state = run(directory, kind, workers, total)[1]
        assert seen == reference, (stops, seen, reference)
        assert same(state, want)


@pytest.mark.parametrize("workers", [0, 2])
def test_random_augmentation_is_exact_with_seed_samples(tmp_path, workers):
    reference, want = run(str(tmp_path / "ref"), "shuffle", workers, 16, noise=True, compressor=lowdiff.TopK(0.5))
    directory = str(tmp_path / "ckpt")
    first, _ = run(directory, "shuffle", workers, 5, noise=True, compressor=lowdiff.TopK(0.5))
    rest, state = run(directory, "shuffle", workers, 16, noise=True, compressor=lowdiff.TopK(0.5))
    assert first + rest == reference and same(state, want)


def test_next_epoch_names_the_epoch_a_loop_continues(tmp_path):
    loader = lowdiff.ResumableLoader(make_loader("shuffle", 0), seed=5)
    assert loader.next_epoch == 0
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    again = lowdiff.ResumableLoader(make_loader("shuffle", 0), seed=99)
    again.load_state_dict(state)
    assert again.next_epoch == 0 and again.epoch == 0 and again.position == 3
    assert [b[2].tolist() for b in again] == [b[2].tolist() for b in batches]
    assert again.next_epoch == 1
    # later epochs follow from the saved seed, not the one the new loader was made with
    assert [b[2].tolist() for b in again] == [b[2].tolist() for b in loader]


@pytest.mark.parametrize("workers", [0, 2])
def test_an_epoch_stopped_after_len_batches_gives_the_same_next_epoch(workers):
    """RandomSampler draws one more permutation when it is run to exhaustion (a for loop) and not
    when the consumer stops after len() batches (Lightning's fetcher): the next epoch, and a
    loader resumed at an epoch's end, must not depend on which."""
    def epochs(count: int, stop_at_len: bool, state=None):
        loader = lowdiff.ResumableLoader(make_loader("shuffle", workers), seed=5)
        if state is not None:
            loader.load_state_dict(state)
        orders, states = [], []
        for _ in range(count):
            batches, order = iter(loader), []
            for _ in range(len(loader)):
                order += next(batches)[2].tolist()
            if not stop_at_len:
                assert next(batches, None) is None
            orders.append(order)
            states.append(loader.state_dict())
        return orders, states
    exhausted, states = epochs(3, stop_at_len=False)
    stopped, _ = epochs(3, stop_at_len=True)
    assert stopped == exhausted and len({tuple(order) for order in exhausted}) == 3
    resumed, _ = epochs(2, stop_at_len=True, state=states[0])
    assert resumed == exhausted[1:]


def test_an_iterable_dataset_is_refused_with_what_to_do():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))
    with pytest.raises(TypeError, match="IterableDataset.*state_dict"):
        lowdiff.ResumableLoader(DataLoader(Stream()))


TRAINER = """
import sys, torch
sys.path.insert(0, {tests!r})
from test_data_order import run
seen, state = run({directory!r}, "shuffle", 2, 30)
"""


def test_sigkill_mid_epoch_then_resume_continues_exactly(tmp_path):
    """A real trainer with worker processes, killed while it runs, resumed by a fresh process."""
    reference, want = run(str(tmp_path / "ref"), "shuffle", 2, 30)
    directory = str(tmp_path / "ckpt")
    script = TRAINER.format(tests=os.path.dirname(__file__), directory=directory)
    env = {**os.environ, "LOWDIFF_FAULT": "batch-commit:4"}   # SIGKILLs itself at the 4th batch commit
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    seen, state = run(directory, "shuffle", 2, 30)
    assert reference[-len(seen):] == seen and len(seen) < len(reference)
    assert same(state, want)
