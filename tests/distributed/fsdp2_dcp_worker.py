"""One rank of the FSDP2 model of fsdp2_worker.py, started from a DCP checkpoint (what
``python -m lowdiff export --format dcp`` wrote); used by test_fsdp2_dcp.py.

It builds a fresh FSDP2 model and optimizer at --world ranks and loads the checkpoint into them with
get_state_dict / dcp.load / set_state_dict (the guide's recipe), writes "loaded STEP GATHERED", then
trains to --steps, with lowdiff (--lowdiff DIR: the recipe to start a lowdiff run from a DCP
checkpoint, resumed from DIR when DIR holds a checkpoint) or without it, writing "STEP DIGEST" after
every step. --crash-at K: every rank SIGKILLs itself after step K.
"""
import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(__file__))
from fsdp2_worker import build, digest, gathered  # noqa: E402

import lowdiff  # noqa: E402
import recovery  # noqa: E402


def load_dcp(model, opt, checkpoint: str) -> int:
    """The guide's recipe: the flattened keys get_state_dict gives, filled in place by dcp.load
    (each rank reads its own chunks), set back into the live model and optimizer."""
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_sd, optim_sd = get_state_dict(model, opt, options=options)
    state = {**model_sd, **optim_sd, "lowdiff.step": 0}
    written = set(dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata)
    if written != set(state):   # the export's keys are exactly get_state_dict's flattened ones
        raise AssertionError(f"keys only in the checkpoint: {sorted(written - set(state))}; "
                             f"only in get_state_dict: {sorted(set(state) - written)}")
    dcp.load(state, checkpoint_id=checkpoint)
    set_state_dict(model, opt, model_state_dict={k: state[k] for k in model_sd},
                   optim_state_dict={k: state[k] for k in optim_sd}, options=options)
    return int(state["lowdiff.step"])


def main():
    p = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "steps"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--dcp", required=True)
    p.add_argument("--digests", required=True)
    p.add_argument("--lowdiff", help="checkpoint the run with lowdiff into this directory")
    p.add_argument("--crash-at", type=int)
    p.add_argument("--load-only", action="store_true")
    args = p.parse_args()
    args.tied, args.optimizer, args.hsdp, args.mp = False, "adamw", False, None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    model, opt, sched, sampler = build(args)
    base = load_dcp(model, opt, args.dcp)
    sched.last_epoch = base   # StepLR decays from the exported step on (the lr itself is in param_groups)
    start = 0
    if args.lowdiff:
        opt = lowdiff.wrap(opt, model, args.lowdiff, compressor=lowdiff.Dense(), full_every=4, batch_steps=2,
                           scheduler=sched, extra_state={"sampler": sampler})
        start = int(recovery.resume(args.lowdiff, model, opt))   # lowdiff counts steps from its own start
    data = torch.randn(64, 8, generator=torch.Generator().manual_seed(7))
    target = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(8))
    with open(args.digests, "a") as out:
        out.write(f"loaded {base + start} {gathered(model, opt, sched)}\n")
        out.flush()
        for step in range(base + start, base if args.load_only else args.steps):
            idx = sampler.next_batch(8)
            torch.nn.functional.cross_entropy(model(data[idx]), target[idx]).backward()
            opt.step()
            if not args.lowdiff:
                sched.step()   # lowdiff's step does it (scheduler=)
            opt.zero_grad()
            out.write(f"{step + 1} {digest(model, opt, sched, sampler)}\n")
            out.flush()
            if args.crash_at == step + 1:
                os.kill(os.getpid(), signal.SIGKILL)
    if args.lowdiff:
        opt.close()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)   # torch 2.13 + gloo abort at interpreter exit


if __name__ == "__main__":
    main()
