"""Question: does torchdata's StatefulDataLoader continue exactly after a state_dict() /
load_state_dict() round trip, without lowdiff — the same batches, and the global RNG a training
step draws from (dropout) unchanged — and if not, is it a usage error or its own bug?

For each loader configuration and number of workers, an uninterrupted run iterates EPOCHS epochs
of a 40-sample dataset in batches of 4 (10 per epoch); after every batch it draws one number from
the global torch RNG (the training step) and saves (loader.state_dict(), torch RNG state), the
state a checkpoint taken at that step boundary would hold. A resumed run starts in a process whose
global RNG is elsewhere, builds the loader as the script does, loads the saved loader state, sets
the global RNG to the saved one (as recovery.resume does) and iterates until it has as many batches
as the uninterrupted run. Resume points: mid-epoch 0, at epoch 0's last batch (inside the loop),
after epoch 0's loop ended, mid-epoch 1. Columns:
  order   every later batch holds the same sample indices
  aug     every later sample's random augmentation (drawn where the sample is computed) is the same
  rng     every later step's global draw is the same
  empty   the number of iter() passes that yielded no batch (an epoch counter would count them)
  first   the first resume point (batches done) where order or rng broke

Configurations:
  shuffle            StatefulDataLoader(shuffle=True)
  shuffle+gen        StatefulDataLoader(shuffle=True, generator=g)
  torch-sampler+gen  StatefulDataLoader(sampler=torch.utils.data.RandomSampler(data, generator=g))
  td-sampler+gen     StatefulDataLoader(sampler=torchdata...sampler.RandomSampler(data, generator=g))
  td-sampler+gen,loader-gen   the same, and StatefulDataLoader(generator=g2), a second generator
  recipe             the same, and the augmentation seeded per sample (from its index)
  sequential         StatefulDataLoader(shuffle=False)
  resumable          lowdiff.ResumableLoader(DataLoader(shuffle=True), seed_samples=True), for comparison

Usage: python experiments/stateful_dataloader_roundtrip.py [--epochs 3] [--workers 0 2] [--csv F]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys

import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lowdiff  # noqa: E402

SAMPLES, BATCH = 40, 4
PER_EPOCH = SAMPLES // BATCH
CONFIGS = ("shuffle", "shuffle+gen", "torch-sampler+gen", "td-sampler+gen", "td-sampler+gen,loader-gen",
           "recipe", "sequential", "resumable")


class Augmented(Dataset):
    """(index, a random augmentation): drawn from the RNG of whichever process computes the sample,
    or, with ``per_sample``, from a generator seeded by the index and the epoch the sampler is in."""

    def __init__(self, per_sample: bool = False):
        self.per_sample, self.sampler = per_sample, None

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        if self.per_sample:
            return torch.tensor([i, torch.randint(1 << 20, (), generator=torch.Generator().manual_seed(i)).item()])
        return torch.tensor([i, torch.randint(1 << 20, ()).item()])


def build(config: str, workers: int):
    """The loader as a training script builds it, after seeding the global RNG."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    from torchdata.stateful_dataloader.sampler import RandomSampler as StatefulRandomSampler

    torch.manual_seed(0)
    data, options = Augmented(config == "recipe"), {"batch_size": BATCH, "num_workers": workers}
    if config == "shuffle":
        return StatefulDataLoader(data, shuffle=True, **options)
    if config == "shuffle+gen":
        return StatefulDataLoader(data, shuffle=True, generator=torch.Generator().manual_seed(7), **options)
    if config == "torch-sampler+gen":
        return StatefulDataLoader(data, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(7)),
                                  **options)
    if config == "td-sampler+gen":
        sampler = StatefulRandomSampler(data, generator=torch.Generator().manual_seed(7))
        return StatefulDataLoader(data, sampler=sampler, **options)
    if config in ("td-sampler+gen,loader-gen", "recipe"):
        sampler = StatefulRandomSampler(data, generator=torch.Generator().manual_seed(7))
        return StatefulDataLoader(data, sampler=sampler, generator=torch.Generator().manual_seed(8), **options)
    if config == "sequential":
        return StatefulDataLoader(data, shuffle=False, **options)
    return lowdiff.ResumableLoader(DataLoader(data, shuffle=True, **options), seed=7, seed_samples=True)


def train(loader, total: int, records: list, states: dict | None = None) -> int:
    """Iterate until ``records`` holds ``total`` batches; returns the passes that yielded nothing.
    ``states[(batches done, ended)]``: the saved state inside the loop, and after it ended."""
    empty = 0
    while len(records) < total:
        yielded = 0
        for batch in loader:
            yielded += 1
            records.append((tuple(batch[:, 0].tolist()), tuple(batch[:, 1].tolist()),
                            int(torch.randint(1 << 30, ()).item())))
            if states is not None:
                states[(len(records), False)] = (loader.state_dict(), torch.get_rng_state())
            if len(records) == total:
                break
        if states is not None:
            states[(len(records), True)] = (loader.state_dict(), torch.get_rng_state())
        empty += yielded == 0
        if empty > 2:
            raise RuntimeError("the loader yields nothing")
    return empty


def trial(config: str, workers: int, epochs: int) -> dict:
    total = epochs * PER_EPOCH
    reference: list = []
    states: dict = {}
    train(build(config, workers), total, reference, states)
    points = {"mid-epoch-0": (3, False), "epoch-0-last-batch": (PER_EPOCH, False),
              "epoch-0-ended": (PER_EPOCH, True), "mid-epoch-1": (PER_EPOCH + 4, False)}
    row = {"config": config, "workers": workers, "order": "exact", "aug": "exact", "rng": "exact", "empty": 0,
           "first": ""}
    for name, (done, ended) in points.items():
        loader_state, rng_state = states[(done, ended)]
        torch.manual_seed(12345)                                 # a new process: the RNG is elsewhere
        loader = build(config, workers)
        loader.load_state_dict(loader_state)
        torch.set_rng_state(rng_state)                           # what recovery.resume restores
        records: list = []
        row["empty"] += train(loader, total - done, records)
        same = [[got[k] for got in records] == [want[k] for want in reference[done:]] for k in range(3)]
        for column, ok in zip(("order", "aug", "rng"), same):
            if not ok:
                row[column] = "DIVERGES"
        if not all(same) and not row["first"]:
            row["first"] = name
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--csv", default="stateful_dataloader_roundtrip.csv")
    args = parser.parse_args()
    import torchdata
    print(f"torch {torch.__version__}, torchdata {torchdata.__version__}, {args.epochs} epochs of {PER_EPOCH} "
          f"batches; resume points: mid-epoch 0, epoch 0's last batch, after epoch 0's loop, mid-epoch 1")
    rows = [trial(config, workers, args.epochs) for config in CONFIGS for workers in args.workers]
    header = (f"{'config':<26} {'workers':>7} {'order':>9} {'aug':>9} {'rng':>9} {'empty':>6}  "
              f"first failing resume point")
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['config']:<26} {row['workers']:>7} {row['order']:>9} {row['aug']:>9} {row['rng']:>9} "
              f"{row['empty']:>6}  {row['first'] or '-'}")
    with open(args.csv, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import plotting  # experiments/plotting.py: the figure, drawn from the CSV alone
    print(plotting.try_draw(args.csv))


if __name__ == "__main__":
    main()
