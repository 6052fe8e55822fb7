"""One rank of a small DDP run (gloo, CPU) writing a partitioned directory. Used by
test_partitioned.py.

Each line of --digests: "STEP FULL SHARED" — FULL hashes everything this rank holds (model with
buffers, optimizer, scheduler, sampler, RNG), SHARED only what is the same on every rank (parameters
and optimizer state). The first line is "resumed STEP FULL SHARED".
"""
import argparse
import hashlib
import os
import random
import signal
import sys
import time
import types

import numpy as np
import torch
import torch.distributed as dist

import lowdiff
import lowdiff.store.directory
import recovery
from lowdiff.cli.demo import ShuffledSampler, state_digest


class Net(torch.nn.Module):
    def __init__(self, unused: bool, tied: bool = False):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
                                        torch.nn.Dropout(0.2), torch.nn.Linear(64, 64), torch.nn.ReLU())
        self.head = torch.nn.Linear(64, 4)
        self.unused = torch.nn.Linear(64, 4) if unused else None   # never in the graph
        self.mirror = None
        if tied:   # a second layer that is the body's 64x64 weight (one parameter, two state-dict names)
            self.mirror = torch.nn.Linear(64, 64, bias=False)
            self.mirror.weight = self.body[4].weight

    def forward(self, x):
        h = self.body(x)
        return self.head(h if self.mirror is None else h + self.mirror(h))


def shared_digest(model, optimizer) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode() + p.detach().numpy().tobytes())
    state = optimizer.state_dict()
    for index in sorted(state["state"]):
        for key, value in sorted(state["state"][index].items()):
            h.update(f"{index}/{key}".encode() + (value.numpy().tobytes() if isinstance(value, torch.Tensor)
                                                  else repr(value).encode()))
    h.update(repr(state["param_groups"]).encode())
    return h.hexdigest()


def exported_step_and_digest(path) -> tuple[int, str]:
    """(step, shared_digest) of a ``python -m lowdiff export`` file of this worker's model, loaded
    into a fresh Net and AdamW as a user would."""
    exported = torch.load(path, weights_only=True)
    torch.manual_seed(0)
    model = Net(unused=False)
    model.load_state_dict(exported["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt.load_state_dict(exported["optimizer"])
    return exported["step"], shared_digest(model, opt)


def build(args):
    torch.manual_seed(0)  # same initial weights on every rank
    model = Net(unused=args.unused, tied=args.tied)
    flags = {"find_unused_parameters": args.unused, "gradient_as_bucket_view": args.bucket_view,
             "static_graph": args.static_graph}
    ddp = torch.nn.parallel.DistributedDataParallel(model, **flags) if args.world > 1 else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    sampler = ShuffledSampler(size=64, seed=args.rank)
    torch.manual_seed(100 + args.rank)  # each rank draws its own dropout masks
    random.seed(args.rank)
    np.random.seed(args.rank)
    return model, ddp, opt, sched, sampler


def compressor(name):
    if name == "dense":
        return lowdiff.Dense()
    return lowdiff.TopK(ratio=0.1, min_numel=64, error_feedback=name == "topk-ef")


def train(args, model, ddp, opt, sched, sampler, start, out):
    data = torch.randn(64, 16, generator=torch.Generator().manual_seed(7))
    target = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(8))
    for step in range(start, args.steps):
        for micro in range(args.accum):
            idx = sampler.next_batch(8)
            last = micro == args.accum - 1
            context = ddp.no_sync() if not last and hasattr(ddp, "no_sync") else _nothing()
            with context:
                loss = torch.nn.functional.cross_entropy(ddp(data[idx]), target[idx]) / args.accum
                loss.backward()
        opt.step()
        opt.zero_grad()
        if args.flush:
            opt.flush()
        out.write(f"{step + 1} {state_digest(model, opt, sched, sampler)} {shared_digest(model, opt)}\n")
        out.flush()
        if args.crash_at == step + 1 and args.rank in args.crash_ranks and first_attempt():
            os.kill(os.getpid(), signal.SIGKILL)


def first_attempt() -> bool:
    """Under torchrun, whether this is the job's first start (a restart must not crash again)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def time_travel(args, model, ddp, opt, sched, sampler):
    with open(args.digests, "a") as out:
        for step in args.travel:
            try:
                got = recovery.resume(args.dir, ddp, opt, step=step, scheduler=sched, extra_state={"sampler": sampler})
            except lowdiff.NoCheckpointError as exc:
                out.write(f"travel-error {step} {exc}\n")
                continue
            assert int(got) == step, (got, step)
            out.write(f"travel {step} {state_digest(model, opt, sched, sampler)} {shared_digest(model, opt)}\n")
    if args.world > 1:
        # The last collective was rank 0's broadcast of a plan: rank 0 may be done before the
        # others have read it, and a process group torn down under a reader aborts it.
        dist.barrier()
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    for name in ("rank", "world", "port"):
        p.add_argument(f"--{name}", type=int, help="not with --torchrun")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--torchrun", action="store_true",
                   help="started by torchrun: rank, world size and rendezvous from its environment; --digests "
                        "gets '-RANK.txt' appended")
    p.add_argument("--late-restart", type=float, default=0.0,
                   help="with --torchrun: seconds the --crash-ranks wait before joining a restarted job")
    p.add_argument("--dir", required=True)
    p.add_argument("--digests", required=True)
    p.add_argument("--compressor", default="topk", choices=["topk", "topk-ef", "dense"])
    p.add_argument("--accum", type=int, default=1)
    setting = lambda v: v if v == "auto" else int(v)  # noqa: E731
    p.add_argument("--full-every", type=setting, default=6)
    p.add_argument("--batch-steps", type=setting, default=3)
    p.add_argument("--crash-at", type=int)
    p.add_argument("--crash-ranks", type=lambda s: {int(r) for r in s.split(",")}, default=set())
    p.add_argument("--unused", action="store_true")
    p.add_argument("--tied", action="store_true", help="a layer tied to another (Net's mirror)")
    p.add_argument("--warm", action="store_true",
                   help="one step before resume: the optimizer has state (resume reads into it)")
    p.add_argument("--bucket-view", action="store_true")
    p.add_argument("--static-graph", action="store_true")
    p.add_argument("--flush", action="store_true", help="flush after every step")
    p.add_argument("--replica", action="store_true", help="replica mode (LowDiff+; with --compressor dense)")
    p.add_argument("--shared-dir", help="storage tiers: stage the checkpoints to this shared directory")
    p.add_argument("--stripe-dirs", type=lambda s: tuple(s.split(",")), default=(),
                   help="the node's other drives (Options(stripe_dirs=...)), comma-separated")
    p.add_argument("--resume-only", action="store_true", help="resume, write the digest line, stop")
    p.add_argument("--resume-step", type=int, help="resume the wrapped optimizer at this step (time travel), "
                                                   "then train on")
    p.add_argument("--lowest-session", action="store_true",
                   help="name this run's session 00000000, before any other (rank 0's is every rank's)")
    p.add_argument("--travel", type=lambda s: [int(k) for k in s.split(",")],
                   help="resume a plain optimizer at each of these steps (read only), write 'travel K FULL "
                        "SHARED' or 'travel-error K MESSAGE' lines, stop")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.torchrun:
        args.rank, args.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        args.digests = f"{args.digests}-{args.rank}.txt"
        if not first_attempt() and args.rank in args.crash_ranks:
            time.sleep(args.late_restart)   # a replacement process that comes up after its peers
        lowdiff.init_process_group("gloo")
    elif args.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world)
    model, ddp, opt, sched, sampler = build(args)
    if args.warm:
        ddp(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    if args.lowest_session:   # sets of two sessions at one step: the order of their names is not the answer
        lowdiff.store.directory.secrets = types.SimpleNamespace(token_hex=lambda nbytes: "0" * (2 * nbytes))
    if args.travel:
        time_travel(args, model, ddp, opt, sched, sampler)
        end_process()
    when = {"schedule": lowdiff.Replica(full_every=args.full_every, batch_steps=args.batch_steps)} if args.replica \
        else {"full_every": args.full_every, "batch_steps": args.batch_steps}
    if args.shared_dir:
        when["tiers"] = lowdiff.Tiers(args.shared_dir)
    if args.stripe_dirs:
        when["options"] = lowdiff.Options(stripe_dirs=args.stripe_dirs)
    opt = lowdiff.wrap(opt, ddp, args.dir, compressor=compressor(args.compressor), scheduler=sched,
                       extra_state={"sampler": sampler}, **when)
    start = recovery.resume(args.dir, ddp, opt, step=args.resume_step)
    with open(args.digests, "a") as out:
        out.write(f"resumed {start} {state_digest(model, opt, sched, sampler)} {shared_digest(model, opt)}\n")
        out.write(f"from-full {start.full_step}\n")
        out.flush()
        if not args.resume_only:
            train(args, model, ddp, opt, sched, sampler, start, out)
    opt.close()
    if args.world > 1:
        dist.destroy_process_group()
    end_process()


def end_process() -> None:
    """End the worker here, inside main(), while its objects (the DDP module, which holds the process
    group) are still alive; everything is closed and flushed by now. Two torch 2.13 + gloo teardown
    faults make a run that ended correctly look failed: a process may abort at interpreter exit
    after destroy_process_group (docs/guide.md, "Platform notes"), and freeing a gloo process group
    right after a collective can deadlock: its destructor, holding the GIL, waits for a lock its
    worker thread holds while that thread frees the finished work, which needs the GIL (gdb, a
    barrier then main() returning: ~ProcessGroupGloo against ~AsyncBarrierWork; 3 in 60 forked
    2-rank runs of plain DDP). An exception still leaves main() the usual way."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
