"""The demo trainer: a small model trained with per-step checkpoints, used by ``python -m lowdiff
demo`` and by the integration tests (as a real subprocess that gets SIGKILLed).

``python -m lowdiff.cli.demo train DIR --steps N [--digests FILE]`` trains from the newest durable state
in DIR (or from scratch), printing ``step N`` after each step, and appends a digest of the full
training state after every step to FILE. Digests are SHA-256 over the exact bytes of model,
optimizer state, scheduler, sampler and RNG states, so equal digests mean bit-identical state.
"""
from __future__ import annotations

import argparse
import hashlib
import random
import sys
from typing import Any

import numpy as np
import torch

import lowdiff


class ShuffledSampler:
    """A stateful data sampler: yields sample indices of a shuffled epoch; resumable mid-epoch."""

    def __init__(self, size: int, seed: int):
        self.size, self.seed, self.epoch, self.position = size, seed, 0, 0

    def next_batch(self, batch: int) -> torch.Tensor:
        out: list[int] = []
        while len(out) < batch:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
            take = min(batch - len(out), self.size - self.position)
            out.extend(order[self.position:self.position + take].tolist())
            self.position += take
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return torch.tensor(out)

    def state_dict(self):
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state):
        self.epoch, self.position = state["epoch"], state["position"]


def build(optimizer: str = "adamw", seed: int = 0):
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    else:
        raise ValueError(f"optimizer={optimizer!r} is not adamw or sgd")
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=200)
    sampler = ShuffledSampler(size=1000, seed=seed)
    return model, opt, sched, sampler


DATA = None


def batch(sampler: ShuffledSampler, size: int = 32):
    global DATA
    if DATA is None:
        g = torch.Generator().manual_seed(1234)
        DATA = (torch.randn(1000, 32, generator=g), torch.randint(0, 10, (1000,), generator=g))
    idx = sampler.next_batch(size)
    # numpy and python RNG are used too, so their states matter for exactness.
    noise = float(np.random.rand()) * 1e-3 + random.random() * 1e-3
    return DATA[0][idx] + noise, DATA[1][idx]


def forward_backward(model, sampler, clip: bool = True) -> torch.Tensor:
    """One training iteration up to the optimizer step: the next batch, forward in train mode
    (BatchNorm statistics, Dropout), backward, gradient clipping (unless ``clip`` is off). Returns
    the loss."""
    x, y = batch(sampler)
    model.train()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    return loss


def state_digest(model, optimizer, scheduler, sampler) -> str:
    h = hashlib.sha256()

    def add_tensor(t: torch.Tensor):
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        add_tensor(value)
    opt_state = optimizer.state_dict()
    for index in sorted(opt_state["state"]):
        for key, value in sorted(opt_state["state"][index].items()):
            h.update(f"{index}/{key}".encode())
            add_tensor(value) if isinstance(value, torch.Tensor) else h.update(repr(value).encode())
    h.update(repr(opt_state["param_groups"]).encode())
    h.update(repr(sorted(scheduler.state_dict().items())).encode())
    h.update(repr(sampler.state_dict()).encode())
    add_tensor(torch.get_rng_state())
    h.update(repr(random.getstate()).encode())
    legacy = np.random.get_state(legacy=True)
    # numpy types it as dict | tuple; the global generator is MT19937, whose legacy state is the tuple.
    assert isinstance(legacy, tuple), "numpy's global generator is not MT19937"
    h.update(repr(legacy[1].tolist()).encode())
    return h.hexdigest()


def compressor_from(name: str, ratio: float):
    if name == "dense":
        return lowdiff.Dense()
    if name == "topk":
        return lowdiff.TopK(ratio=ratio, min_numel=512)
    raise ValueError(f"compressor={name!r} is not dense or topk")


def train(directory: str | None, steps: int, *, optimizer="adamw", compressor="topk", ratio=0.05,
          full_every=10, batch_steps=4, digests=None, log=print, replica=False, clip=True, tiers=None,
          stripe_dirs=()) -> dict:
    """Train to ``steps`` completed steps (resuming from ``directory`` when it holds a checkpoint;
    ``directory=None`` trains without lowdiff). Returns {"start", "digests": {step: digest}}.
    ``replica``: lowdiff's replica mode (dense gradients); ``clip``: clip gradients after backward;
    ``tiers``: lowdiff.tiers.Tiers (stage to a shared directory); ``stripe_dirs``: other drives' directories
    full checkpoints are striped over (``lowdiff.Options(stripe_dirs=...)``)."""
    model, opt, sched, sampler = build(optimizer)
    start = 0
    if directory is not None:
        when = {"schedule": lowdiff.Replica(full_every=full_every, batch_steps=batch_steps)} if replica else \
            {"full_every": full_every, "batch_steps": batch_steps}
        opt = lowdiff.wrap(opt, model, directory, compressor=compressor_from(compressor, ratio), scheduler=sched,
                           extra_state={"sampler": sampler}, tiers=tiers,
                           options=lowdiff.Options(stripe_dirs=tuple(stripe_dirs)), **when)
        import recovery  # (lowdiff reaches recovery only inside its cli and integrations)

        start = recovery.resume(directory, model, opt)
        if tiers is not None:
            log(f"tier {start.tier or 'local'}")
    out: dict[str, Any] = {"start": start, "digests": {}}
    if start:
        out["digests"][start] = state_digest(model, opt, sched, sampler)
        log(f"resumed at step {start} {out['digests'][start]}")
    comp = compressor_from(compressor, ratio) if directory is None else None
    for step in range(start, steps):
        loss = forward_backward(model, sampler, clip=clip)
        if comp is not None:  # the reference run applies the same compression, without lowdiff
            _compress_in_place(opt, comp)
        opt.step()
        if directory is None:
            sched.step()
        opt.zero_grad()
        digest = state_digest(model, opt, sched, sampler)
        out["digests"][step + 1] = digest
        if digests is not None:
            digests.write(f"{step + 1} {digest}\n")
            digests.flush()
        # What the trainer reports durable (committed) after this step: a kill may lose nothing up to it.
        durable = f" durable {opt.durable_step}" if directory is not None else ""
        log(f"step {step + 1} loss {loss.item():.4f}{durable}")
    if directory is not None:
        opt.close()
    return out


def _compress_in_place(opt, comp) -> None:
    from lowdiff.step.compress import decompress_into

    for p in (p for g in opt.param_groups for p in g["params"]):
        if p.grad is not None:
            record = comp.compress(p.grad, 0, {})
            if record.kind == "sparse":
                decompress_into(record, p.grad)


def policy_from(text: str):
    """A retention policy from ``last:N``, ``every:K:N`` or ``all``."""
    from lowdiff.tiers.policy import KeepAll, KeepEvery, KeepLast

    kind, *numbers = text.split(":")
    if kind == "all" and not numbers:
        return KeepAll()
    if kind == "last" and len(numbers) == 1:
        return KeepLast(int(numbers[0]))
    if kind == "every" and len(numbers) == 2:
        return KeepEvery(int(numbers[0]), last=int(numbers[1]))
    raise ValueError(f"retention policy {text!r} is not last:N, every:K:N or all")


def _tiers_from(args):
    from lowdiff.tiers.policy import Tiers

    if not args.shared_dir:
        return None
    from lowdiff.tiers.objectstore import ObjectStore

    return Tiers(args.shared_dir, local=policy_from(args.local_policy) if args.local_policy else None,
                 shared=policy_from(args.shared_policy),
                 object_store=ObjectStore(part_bytes=args.s3_part_bytes) if args.s3_part_bytes else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lowdiff.cli.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["train", "reference"])
    parser.add_argument("directory", nargs="?")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    parser.add_argument("--compressor", default="topk", choices=["topk", "dense"])
    parser.add_argument("--ratio", type=float, default=0.05)
    parser.add_argument("--full-every", type=int, default=10)
    parser.add_argument("--batch-steps", type=int, default=4)
    parser.add_argument("--digests", help="append 'step digest' lines to this file")
    parser.add_argument("--replica", action="store_true", help="replica mode (LowDiff+; needs --compressor dense)")
    parser.add_argument("--no-clip", action="store_true", help="no gradient clipping after backward")
    parser.add_argument("--shared-dir", help="storage tiers: the shared directory DIR is staged to")
    parser.add_argument("--shared-policy", default="last:2", help="shared tier retention: last:N, every:K:N or all")
    parser.add_argument("--local-policy", help="local tier retention (default: last:2)")
    parser.add_argument("--s3-part-bytes", type=int, help="an s3:// shared tier's multipart part size")
    parser.add_argument("--stripe-dir", action="append", default=[],
                        help="another drive's directory full checkpoints are striped over (repeatable)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    digests = open(args.digests, "a") if args.digests else None
    try:
        train(args.directory if args.mode == "train" else None, args.steps, optimizer=args.optimizer,
              compressor=args.compressor, ratio=args.ratio, full_every=args.full_every,
              batch_steps=args.batch_steps, digests=digests, log=lambda m: print(m, flush=True),
              replica=args.replica, clip=not args.no_clip, tiers=_tiers_from(args), stripe_dirs=args.stripe_dir)
    finally:
        if digests:
            digests.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
