"""One rank of a small FSDP2 run (fully_shard on each Linear and the root, gloo, CPU) that lowdiff
checkpoints into a partitioned directory; used by test_fsdp2_resume.py.

Each line of --digests: "STEP GATHERED DIGEST": GATHERED hashes the parameters and optimizer state
gathered to full tensors (the same at any world size), DIGEST everything this rank holds (its local
chunks of the parameters and optimizer state, the scheduler, the sampler, every RNG). The first line
is "resumed STEP GATHERED DIGEST". With --crash-at K every rank SIGKILLs itself after step K (as torchrun kills a
job), without flushing.
"""
import argparse
import hashlib
import logging
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

import lowdiff
import recovery
from lowdiff.cli.demo import ShuffledSampler


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def digest(model, opt, sched, sampler) -> str:
    h = hashlib.sha256()

    def add(t):
        t = local(t).detach().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode() + (t.view(-1).view(torch.uint8).numpy().tobytes()
                                                             if t.numel() else b""))
    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        add(value)
    state = opt.state_dict()
    for index in sorted(state["state"]):
        for key, value in sorted(state["state"][index].items()):
            h.update(f"{index}/{key}".encode())
            add(value) if isinstance(value, torch.Tensor) else h.update(repr(value).encode())
    h.update(repr(state["param_groups"]).encode())
    h.update(repr(sorted(sched.state_dict().items())).encode())
    h.update(repr(sampler.state_dict()).encode())
    add(torch.get_rng_state())
    h.update(repr(random.getstate()).encode() + repr(np.random.get_state(legacy=True)[1].tolist()).encode())
    return h.hexdigest()


def gathered(model, opt, sched) -> str:
    """A hash of the state gathered to full tensors (a collective): the same at any world size."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t
    state = opt.state_dict()
    return gathered_of({k: full(v) for k, v in model.state_dict().items()},
                       {i: {k: full(v) for k, v in s.items()} for i, s in state["state"].items()},
                       state["param_groups"])


def gathered_of(model_state: dict, optimizer_state: dict, param_groups: list) -> str:
    """The hash ``gathered`` computes, of full tensors (also of what ``python -m lowdiff export`` wrote)."""
    h = hashlib.sha256()

    def raw(t):
        return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    for key, value in sorted(model_state.items()):
        h.update(key.encode() + raw(value))
    for index in sorted(optimizer_state):
        for key, value in sorted(optimizer_state[index].items()):
            h.update(f"{index}/{key}".encode() + raw(value))
    h.update(repr([sorted((k, v) for k, v in g.items() if k != "params") for g in param_groups]).encode())
    return h.hexdigest()


class OwnSGD(torch.optim.SGD):
    """A user's optimizer class (whatever its step does, lowdiff cannot know it is element-wise)."""


class Tied(torch.nn.Module):
    """Takes 8 features as the MLP does; its output layer is tied to an input embedding (one
    parameter, two state-dict names), as a language model's head is."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 6)
        self.embed = torch.nn.Embedding(5, 6)
        self.head = torch.nn.Linear(6, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.relu(self.body(x)) + self.embed.weight.mean(0))


# --mp: FSDP2 mixed-precision policies (test_fsdp2_mixed_precision.py). "bf16" is torchtitan's default
# (bfloat16 compute, float32 reduction); "bf16-reduce" reduces in bfloat16 too and casts the root's
# output back to float32; "fp16" computes in float16, reduction float32.
POLICIES = {
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16-reduce": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                        output_dtype=torch.float32),
    "fp16": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32),
}


def check_mixed_precision(policy, output, model):
    """The policy is in force (the model computes in its dtype) and the optimizer is handed a float32
    gradient chunk of the float32 sharded parameter: what lowdiff records and replays."""
    expected = policy.output_dtype or policy.param_dtype
    weight = model[0].weight
    if output.dtype != expected or weight.dtype != torch.float32 or weight.grad.dtype != torch.float32:
        raise AssertionError(f"{policy}: output {output.dtype}, parameter {weight.dtype}, gradient {weight.grad.dtype}")


def build(args):
    torch.manual_seed(0)   # the same initial weights on every rank (fully_shard keeps each its chunk)
    # HSDP: a (replicate, shard) mesh of 2 rows; fully_shard shards over a row and replicates across rows.
    how = {"mesh": init_device_mesh("cpu", (2, args.world // 2), mesh_dim_names=("replicate", "shard"))} \
        if args.hsdp else {}
    if args.mp:
        how["mp_policy"] = POLICIES[args.mp]
    if args.tied:
        model = Tied()
        fully_shard(model.body)
    else:
        model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                    torch.nn.Linear(24, 5))   # 5 rows: uneven chunks on 2 and 4 ranks
        for layer in (model[0], model[3]):
            fully_shard(layer, **how)
    fully_shard(model, **how)
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif args.optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    else:   # a class lowdiff does not know to work element by element: resharding it is refused
        opt = OwnSGD(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    sampler = ShuffledSampler(size=64, seed=args.rank)
    torch.manual_seed(100 + args.rank)   # each rank its own dropout masks
    random.seed(args.rank)
    np.random.seed(args.rank)
    return model, opt, sched, sampler


def main():
    p = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "steps"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--digests", required=True)
    p.add_argument("--compressor", choices=["dense", "topk", "topk-ef"], default="dense")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "own"], default="adamw")
    p.add_argument("--crash-at", type=int)
    p.add_argument("--resume-only", action="store_true", help="resume, write the 'resumed' line, stop")
    p.add_argument("--resume-step", type=int, help="resume at this step (time travel)")
    p.add_argument("--tied", action="store_true", help="a model with a tied weight (Tied)")
    p.add_argument("--hsdp", action="store_true", help="HSDP: fully_shard on a (2, world / 2) mesh")
    p.add_argument("--mp", choices=sorted(POLICIES), help="fully_shard(..., mp_policy=POLICIES[this])")
    p.add_argument("--sharded-scaler", action="store_true",
                   help="ShardedGradScaler as wrap(grad_scaler=...) (scaler.unscale_ before odd steps); "
                        "rank 0's gradient chunk made inf at step 6")
    p.add_argument("--shared", help="a shared tier (lowdiff.Tiers) the rank directories drain into")
    p.add_argument("--keep-last", type=int, help="retention=lowdiff.KeepLast(this)")
    p.add_argument("--stripe-dirs", type=lambda s: tuple(s.split(",")), default=(),
                   help="the node's other drives (Options(stripe_dirs=...)), comma-separated")
    args = p.parse_args()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")   # lowdiff's warnings on stderr
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    model, opt, sched, sampler = build(args)
    # FSDP2's fp16 recipe: the loss scaled, steps with an inf/nan gradient chunk on any rank skipped
    # on every rank (the scale backs off); a small growth interval so that the scale grows too.
    scaler = ShardedGradScaler(device="cpu", init_scale=2.0 ** 10, growth_interval=3) if args.sharded_scaler else None
    compressor = lowdiff.Dense() if args.compressor == "dense" else \
        lowdiff.TopK(ratio=0.25, min_numel=16, error_feedback=args.compressor == "topk-ef")
    opt = lowdiff.wrap(opt, model, args.dir, compressor=compressor, full_every=4, batch_steps=2, scheduler=sched,
                       extra_state={"sampler": sampler}, tiers=lowdiff.Tiers(args.shared) if args.shared else None,
                       retention=lowdiff.KeepLast(args.keep_last) if args.keep_last else None,
                       options=lowdiff.Options(stripe_dirs=args.stripe_dirs), grad_scaler=scaler)
    start = recovery.resume(args.dir, model, opt, step=args.resume_step)
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
    target = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(8))

    def digest_all():   # with the scaler's scale and growth tracker
        mine = digest(model, opt, sched, sampler)
        return mine if scaler is None else hashlib.sha256(f"{mine} {scaler.state_dict()}".encode()).hexdigest()
    with open(args.digests, "a") as out:
        out.write(f"resumed {int(start)} {gathered(model, opt, sched)} {digest_all()}\n")
        out.flush()
        for step in range(int(start), args.steps if not args.resume_only else int(start)):
            idx = sampler.next_batch(8)
            output = model(data[idx])
            loss = torch.nn.functional.cross_entropy(output.float() if scaler is not None else output, target[idx])
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if args.mp:
                check_mixed_precision(POLICIES[args.mp], output, model)
            if scaler is not None:
                if step + 1 == 6 and args.rank == 0:   # an overflow that lands in rank 0's chunk only
                    model[0].weight.grad.to_local().view(-1)[0] = float("inf")
                if (step + 1) % 2:   # odd steps: unscaled first, as a loop that clips gradients does
                    scaler.unscale_(opt)
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad()
            out.write(f"{step + 1} {gathered(model, opt, sched)} {digest_all()}\n")
            out.flush()
            if args.crash_at == step + 1:
                os.kill(os.getpid(), signal.SIGKILL)
    opt.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)   # torch 2.13 + gloo abort at interpreter exit


if __name__ == "__main__":
    main()
