"""Data order that survives a resume: ``ResumableLoader`` continues a ``DataLoader`` at the batch an
uninterrupted run would have seen next.

A plain DataLoader cannot do that: every ``iter()`` draws the sampler's shuffle seed and the
workers' base seed from the global torch RNG (unless it has a ``generator``), so a loop that calls
``iter()`` again after a resume draws at a point the uninterrupted run did not, and its position
inside an epoch is not saved anywhere. The wrapper gives the loader its own generator (the
loader's or the sampler's when one was passed, else a new one), remembers that generator's state
at the start of each epoch and how many batches of the epoch were handed out, and on resume
rebuilds the epoch from that state, skipping the consumed batches by index (no data is loaded
for them). Pass it to ``wrap(extra_state={"data": loader})``: lowdiff saves its state at every
step boundary with the rest.

Each epoch starts from a generator state derived from (seed, epoch) alone, not from where the
previous epoch left the generator: how far that got depends on the consumer. ``RandomSampler``
draws one more permutation when it is run to exhaustion, which a ``for`` loop does and a consumer
that stops after ``len()`` batches (Lightning's fetcher, a loop that breaks) does not; worker
processes exhaust it early by prefetching indices. An interrupted epoch is rebuilt from its saved
start state, and every later epoch is the same whichever way the earlier ones were consumed.

Random work inside the dataset (augmentation) runs in whichever worker gets a batch, so after a
skip it would see other RNG streams; ``seed_samples=True`` seeds torch, numpy and random from
(seed, epoch, index) around each sample, which makes it independent of workers and skips.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

_LOADER_OPTIONS = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn",
                   "multiprocessing_context", "prefetch_factor", "persistent_workers", "in_order")


class _Skipping:
    """The loader's batch sampler (or sampler), minus the first ``skip`` items of the next pass."""

    def __init__(self, inner, tag_epoch=None):
        self.inner, self.skip, self.tag_epoch = inner, 0, tag_epoch

    def __iter__(self):
        items = iter(self.inner)
        skip, self.skip = self.skip, 0
        for _ in range(skip):
            if next(items, None) is None:
                return
        for item in items:
            yield self.tag_epoch(item) if self.tag_epoch else item

    def __len__(self):
        return len(self.inner)


class _SeededSamples(torch.utils.data.Dataset):
    """Each sample computed under RNGs seeded from (seed, epoch, index); the caller's RNG states
    are left as they were."""

    def __init__(self, dataset, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, tagged):
        epoch, index = tagged
        seed = hash((self.seed, epoch, index)) & 0xFFFF_FFFF
        python, numpy = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                random.seed(seed)
                np.random.seed(seed)
                return self.dataset[index]
        finally:
            random.setstate(python)
            np.random.set_state(numpy)


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 64-bit seed for the generator at the start of ``epoch``: well mixed, so that nearby
    seeds and epochs give unrelated streams."""
    words = np.random.SeedSequence([seed & 0xFFFF_FFFF_FFFF_FFFF, epoch]).generate_state(2, np.uint32)
    return int(words[0]) << 32 | int(words[1])


def _peek_seed() -> int:
    """The number one draw of the global torch RNG would give, with the RNG left as it was.

    A draw would move the RNG, and where the loader is built decides whether that draw is
    checkpointed: Lightning calls ``train_dataloader`` after lowdiff's resume restored the RNG, so
    a resumed run drew once more than the uninterrupted one and every later random number (dropout)
    differed. The seed itself need not match across a resume: it is saved in ``state_dict()``."""
    state = torch.get_rng_state()
    try:
        return int(torch.empty((), dtype=torch.int64).random_().item())
    finally:
        torch.set_rng_state(state)


class ResumableLoader:
    """Iterate like ``loader``; ``state_dict()``/``load_state_dict()`` put a resumed run on the
    exact next batch. ``next_epoch`` is the epoch the next ``iter()`` yields (the interrupted one
    after a resume mid-epoch), for loops written ``for epoch in range(loader.next_epoch, N)``.

    ``seed``: the shuffle generator's seed when neither the loader nor its sampler has a
    generator (default: the next number of the global torch RNG, read without advancing it — see
    _peek_seed).
    """

    def __init__(self, loader: DataLoader, *, seed: int | None = None, seed_samples: bool = False):
        if not isinstance(loader, DataLoader):
            raise TypeError(f"ResumableLoader wraps a torch DataLoader, got {type(loader).__name__}")
        if isinstance(loader.dataset, IterableDataset):
            raise TypeError("ResumableLoader cannot restore a position inside an IterableDataset: give the "
                            "dataset state_dict()/load_state_dict() and pass it in extra_state instead")
        batches: Any = loader.batch_sampler
        sampler: Any = getattr(batches, "sampler", None) if batches is not None else loader.sampler
        self.generator = getattr(sampler, "generator", None) or loader.generator or torch.Generator()
        if getattr(sampler, "generator", None) is None and loader.generator is None:
            self.generator.manual_seed(_peek_seed() if seed is None else seed)
        if hasattr(sampler, "generator"):
            sampler.generator = self.generator   # shuffles from our generator, never the global RNG
        self._sampler: Any = sampler
        self._seed = int(self.generator.initial_seed())
        self._loader = self._rebuild(loader, seed_samples)
        self.next_epoch = 0
        self.epoch = -1                 # the epoch being iterated (-1 before the first)
        self.position = 0               # batches of it handed out
        self._epoch_start = self.generator.get_state()
        self._pending: tuple | None = None

    def _rebuild(self, loader: DataLoader, seed_samples: bool) -> DataLoader:
        options = {name: getattr(loader, name) for name in _LOADER_OPTIONS if hasattr(loader, name)}
        # Persistent workers keep one worker base seed for all epochs, drawn when the first epoch
        # starts; a resume starts its first epoch elsewhere. Workers are started per epoch instead.
        options["persistent_workers"] = False
        if not options.get("num_workers"):
            options.pop("prefetch_factor", None)
        dataset = _SeededSamples(loader.dataset, self._seed) if seed_samples else loader.dataset
        tag = (lambda item: self._tag(item)) if seed_samples else None
        if loader.batch_sampler is not None:
            self._skipping = _Skipping(loader.batch_sampler, tag)
            return DataLoader(dataset, batch_sampler=self._skipping, generator=self.generator, **options)
        self._skipping = _Skipping(loader.sampler, tag)
        return DataLoader(dataset, batch_size=None, sampler=self._skipping, generator=self.generator, **options)

    def _tag(self, item):
        if isinstance(item, (list, tuple)):
            return [(self.epoch, index) for index in item]
        return (self.epoch, item)

    def __len__(self) -> int:
        return len(self._loader)

    def __iter__(self) -> Iterator[Any]:
        self._start_epoch()
        for batch in self._loader:
            self.position += 1
            yield batch

    def _start_epoch(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            epoch, position, epoch_start = pending
            if position < self._epoch_length():          # the interrupted epoch, rebuilt from its start
                self.generator.set_state(epoch_start)
                self.epoch, self.position, self._skipping.skip = epoch, position, position
                self._began()
                return
        self.epoch, self.position = self.next_epoch, 0
        self.generator.manual_seed(_epoch_seed(self._seed, self.epoch))
        self._began()

    def _began(self) -> None:
        self._epoch_start = self.generator.get_state()
        self.next_epoch = self.epoch + 1
        if hasattr(self._sampler, "set_epoch"):         # DistributedSampler shuffles by epoch
            self._sampler.set_epoch(self.epoch)

    def _epoch_length(self) -> float:
        try:
            return len(self._loader)
        except TypeError:
            return float("inf")

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "epoch_start": self._epoch_start.clone(),
                "seed": self._seed}

    def load_state_dict(self, state: dict) -> None:
        """The next ``iter()`` continues epoch ``state["epoch"]`` after its ``position`` batches
        (or starts the next one when those were all), and later epochs follow from the saved seed."""
        self._seed = int(state.get("seed", self._seed))
        if isinstance(self._loader.dataset, _SeededSamples):
            self._loader.dataset.seed = self._seed
        self.generator.set_state(state["epoch_start"])
        self._epoch_start = state["epoch_start"]
        if state["epoch"] < 0:
            self.epoch, self.position, self.next_epoch, self._pending = -1, 0, 0, None
            return
        self._pending = (state["epoch"], state["position"], state["epoch_start"])
        self.epoch, self.position = state["epoch"], state["position"]
        self.next_epoch = state["epoch"] if state["position"] < self._epoch_length() else state["epoch"] + 1
