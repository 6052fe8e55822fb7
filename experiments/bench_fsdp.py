"""Question: under FSDP2 (fully_shard, 2 ranks, gloo, CPU), what does lowdiff's differential every step
cost a training step, against FSDP2 without checkpoints and against torch.distributed.checkpoint (DCP)
saves, and how many bytes does a full checkpoint take against the state?

One run, the same disk, configurations alternating round by round (this machine is shared: the load
average is printed): the GPT-2-style model of gpt.py (--model preset), fully_shard on every block and
the root, AdamW. Per configuration and round, --steps timed steps after --warmup untimed ones:

  none           FSDP2 training, no checkpoints
  lowdiff-dense  lowdiff.wrap(Dense(), full_every=warmup+steps, batch_steps=10): a differential of the
                 local gradient chunk every step (a base full checkpoint before the timed steps, one
                 more at the last step: the median step time leaves it out)
  lowdiff-topk   the same with TopK(0.01)
  dcp-save       dcp.save of get_state_dict(model, optimizer) every --dcp-every steps (synchronous)

A row: the median step time over rounds, its ratio to "none". Bytes: lowdiff's last full checkpoint
(its shares summed over ranks) and one DCP save, each divided by the state (parameters + AdamW state,
whole tensors). Time to durable: lowdiff's last full checkpoint (that step's time beyond the median
step, plus the flush that waits for its shares to be durable) against dcp.save's time. Not measured
yet: async_save, resume against dcp.load (issue #31's benchmark asks for them).

Usage: python experiments/bench_fsdp.py [--model quick] [--steps 20] [--warmup 3] [--rounds 3]
       [--dcp-every 10] [--dir D] [--csv experiments/results/bench_fsdp.csv]
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpt  # noqa: E402

import lowdiff  # noqa: E402

CONFIGS = ("none", "lowdiff-dense", "lowdiff-topk", "dcp-save")
TARGET_OVERHEAD = 0.02
TARGET_BYTES = 1.05


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _rank(rank, world, port, config, args, directory, out):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = gpt.build_model(args.model, seed=0)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    if config.startswith("lowdiff"):
        compressor = lowdiff.Dense() if config == "lowdiff-dense" else lowdiff.TopK(ratio=0.01)
        opt = lowdiff.wrap(opt, model, directory, compressor=compressor, full_every=args.warmup + args.steps,
                           batch_steps=10)
    cfg = gpt.PRESETS[args.model]
    times, dcp_bytes, save_s = [], 0, []
    for step in range(args.warmup + args.steps):
        x, y = gpt.batch(cfg, step, seed=rank)
        dist.barrier()
        started = time.perf_counter()
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        if config == "dcp-save" and (step + 1) % args.dcp_every == 0:
            saving = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(directory, f"step-{step + 1}"))
            save_s.append(time.perf_counter() - saving)
        times.append(time.perf_counter() - started)
    median = statistics.median(times[args.warmup:])
    if config.startswith("lowdiff"):
        flushing = time.perf_counter()
        opt.flush()
        save_s.append(times[-1] - median + time.perf_counter() - flushing)
    state_bytes = 0
    plain = opt.optimizer if hasattr(opt, "optimizer") else opt
    for p in model.parameters():
        state_bytes += p.numel() * p.element_size()
        state_bytes += sum(v.numel() * v.element_size() for v in plain.state[p].values() if isinstance(v, torch.Tensor))
    if config.startswith("lowdiff"):
        opt.close()
    dist.barrier()
    if rank == 0:
        if config == "dcp-save":
            dcp_bytes = _tree_bytes(os.path.join(directory, f"step-{args.dcp_every}"))
        full_bytes = 0
        if config.startswith("lowdiff"):
            fulls = {}
            for r in range(world):
                for name in os.listdir(os.path.join(directory, f"rank-{r:05d}")):
                    if name.startswith("full-"):
                        fulls.setdefault(name.split("-")[1], 0)
                        fulls[name.split("-")[1]] += os.path.getsize(os.path.join(directory, f"rank-{r:05d}", name))
            full_bytes = fulls[max(fulls)] if fulls else 0
        out.put((median, state_bytes, full_bytes, dcp_bytes, statistics.median(save_s) if save_s else 0.0))
    dist.barrier()
    dist.destroy_process_group()


def run(config, args, directory):
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(rank, 2, port, config, args, directory, out)) for rank in range(2)]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="quick", choices=sorted(gpt.PRESETS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dcp-every", type=int, default=10)
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    p.add_argument("--csv", default=os.path.join(REPO_ROOT, "experiments", "results", "bench_fsdp.csv"))
    args = p.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench_fsdp-")
    results: dict = {c: [] for c in CONFIGS}
    state_bytes = full_bytes = dcp_bytes = 0
    durable: dict = {c: [] for c in CONFIGS}
    for round_ in range(args.rounds):
        for config in (CONFIGS if round_ % 2 == 0 else tuple(reversed(CONFIGS))):
            directory = os.path.join(root, f"{config}-{round_}")
            step_s, state_bytes, full, dcp_b, save = run(config, args, directory)
            results[config].append(step_s)
            durable[config].append(save)
            full_bytes = full or full_bytes
            dcp_bytes = dcp_b or dcp_bytes
            shutil.rmtree(directory, ignore_errors=True)
    base = statistics.median(results["none"])
    print(f"FSDP2, 2 ranks, model {args.model}, {args.steps} steps x {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'config':<15}{'step s':>10}{'vs none':>10}{'durable s':>11}")
    rows = []
    for config in CONFIGS:
        step_s = statistics.median(results[config])
        save = statistics.median(durable[config])
        rows.append((config, step_s, step_s / base, save))
        print(f"{config:<15}{step_s:>10.4f}{step_s / base:>10.3f}{save:>11.3f}")
    ratio = full_bytes / state_bytes
    print(f"state {state_bytes / 2**20:.1f} MiB (whole tensors); lowdiff full checkpoint {full_bytes / 2**20:.1f} MiB "
          f"= {ratio:.3f}x; DCP save {dcp_bytes / 2**20:.1f} MiB = {dcp_bytes / state_bytes:.3f}x")
    dense = statistics.median(results["lowdiff-dense"]) / base - 1
    full_vs_dcp = statistics.median(durable["lowdiff-dense"]) / statistics.median(durable["dcp-save"])
    print(f"verdict: differential every step (Dense) overhead {dense:+.1%} (target <= {TARGET_OVERHEAD:.0%}): "
          f"{'met' if dense <= TARGET_OVERHEAD else 'not met'}; bytes {ratio:.3f}x (target <= {TARGET_BYTES}): "
          f"{'met' if ratio <= TARGET_BYTES else 'not met'}; durable full checkpoint {full_vs_dcp:.2f}x DCP save "
          f"(target <= 0.5): {'met' if full_vs_dcp <= 0.5 else 'not met'}")
    os.makedirs(os.path.dirname(args.csv), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["config", "step_s", "ratio_to_none", "durable_s"])
        w.writerows(rows)
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
