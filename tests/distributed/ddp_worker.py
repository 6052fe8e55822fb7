"""One rank of a DDP training run with lowdiff (gloo, CPU). Used by test_ddp_resume.py.

usage: python ddp_worker.py RANK WORLD PORT CKPT_DIR STEPS DIGEST_FILE [CRASH_AT]
Appends "step digest" lines; with CRASH_AT the process SIGKILLs itself right after that step.
"""
import os
import random
import signal
import sys

import numpy as np
import torch
import torch.distributed as dist
from partition_worker import end_process

import lowdiff
import recovery
from lowdiff.cli.demo import ShuffledSampler, state_digest


def main():
    rank, world, port, directory, steps, digest_path = sys.argv[1:7]
    rank, world, steps = int(rank), int(world), int(steps)
    crash_at = int(sys.argv[7]) if len(sys.argv) > 7 else None
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)  # same initial weights on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(128, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    sampler = ShuffledSampler(size=64, seed=rank)
    torch.manual_seed(100 + rank)  # each rank draws its own dropout masks
    random.seed(rank)              # unseeded, python and numpy would differ between runs
    np.random.seed(rank)
    opt = lowdiff.wrap(opt, ddp, directory, compressor=lowdiff.TopK(ratio=0.1, min_numel=64),
                       full_every=6, batch_steps=3, scheduler=sched, extra_state={"sampler": sampler})
    start = recovery.resume(directory, ddp, opt)
    data = torch.randn(64, 16, generator=torch.Generator().manual_seed(7))
    target = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(8))
    with open(digest_path, "a") as out:
        out.write(f"resumed {start} {state_digest(model, opt, sched, sampler)}\n")
        out.flush()
        for step in range(start, steps):
            idx = sampler.next_batch(8)
            loss = torch.nn.functional.cross_entropy(ddp(data[idx]), target[idx])
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.write(f"{step + 1} {state_digest(model, opt, sched, sampler)}\n")
            out.flush()
            if crash_at is not None and step + 1 == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
    opt.close()
    dist.destroy_process_group()
    end_process()   # inside main(): partition_worker.end_process says why


if __name__ == "__main__":
    main()
