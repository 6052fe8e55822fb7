"""One rank of a small DDP run (gloo, CPU) writing a partitioned directory with a shared tier.
Used by test_partitioned_tiers.py. The model, data, compressor and digest lines are
partition_worker's (so both tests' digests compare); this adds the tiers and prints, after the
"resumed" line, "tier NAME" (which tier resume used). With --mark-replay, the replay's first
optimizer step sends a GET for ``lowdiff-marker/replay-rank-R`` to the S3 endpoint (the tests'
proxy logs it among lowdiff's requests: what was fetched before the replay began, without timing).
"""
import argparse
import os
import signal
import urllib.request

import torch
import torch.distributed as dist
from partition_worker import build, compressor, end_process, shared_digest

import lowdiff
import recovery
from lowdiff.cli.demo import state_digest
from lowdiff.tiers import ObjectStore
from lowdiff.tiers.policy import KeepAll, KeepLast, Tiers


def policy(text):
    return KeepAll() if text == "all" else KeepLast(int(text.split(":")[1]))


def mark_first_step(optimizer, rank: int) -> None:
    """At the optimizer's first step, a GET the proxy logs (its answer, an error, is ignored)."""
    def hook(*_):
        handle.remove()
        url = f"{os.environ['AWS_ENDPOINT_URL']}/lowdiff-marker/replay-rank-{rank}"
        try:
            urllib.request.urlopen(url, timeout=10).close()
        except OSError:   # (HTTPError: moto has no such bucket; the request was seen)
            pass
    handle = optimizer.register_step_pre_hook(hook)


def main():
    p = argparse.ArgumentParser()
    for name in ("rank", "world", "port", "steps"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--shared-dir", required=True)
    p.add_argument("--shared-policy", type=policy, default=KeepLast(2))
    p.add_argument("--digests", required=True)
    p.add_argument("--crash-at", type=int)
    p.add_argument("--crash-ranks", type=lambda s: {int(r) for r in s.split(",")}, default=set())
    p.add_argument("--resume-only", action="store_true")
    p.add_argument("--full-every", type=int, default=4)
    p.add_argument("--mark-replay", action="store_true")
    p.add_argument("--deadline-s", type=float, help="ObjectStore(deadline_s=this)")
    p.add_argument("--stripe-dirs", default="", help="Options(stripe_dirs=...), comma-separated; '{rank}' is "
                                                     "replaced by the rank")
    args = p.parse_args()
    # partition_worker's build() reads these; this worker does not vary them
    args.unused, args.bucket_view, args.static_graph, args.tied = False, False, False, False
    torch.set_num_threads(1)
    if args.world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                                world_size=args.world)
    model, ddp, opt, sched, sampler = build(args)
    if args.mark_replay:
        mark_first_step(opt, args.rank)
    opt = lowdiff.wrap(opt, ddp, args.dir, compressor=compressor("topk"), full_every=args.full_every, batch_steps=2,
                       scheduler=sched, extra_state={"sampler": sampler},
                       tiers=Tiers(args.shared_dir, shared=args.shared_policy,
                                   object_store=None if args.deadline_s is None else
                                   ObjectStore(deadline_s=args.deadline_s)),
                       options=lowdiff.Options(stripe_dirs=tuple(d.format(rank=args.rank)
                                                                 for d in args.stripe_dirs.split(",") if d)))
    start = recovery.resume(args.dir, ddp, opt)
    data = torch.randn(64, 16, generator=torch.Generator().manual_seed(7))
    target = torch.randint(0, 4, (64,), generator=torch.Generator().manual_seed(8))
    with open(args.digests, "a") as out:
        out.write(f"resumed {start} {state_digest(model, opt, sched, sampler)} {shared_digest(model, opt)}\n")
        out.write(f"tier {start.tier or '-'}\n")
        out.flush()
        for step in range(start, 0 if args.resume_only else args.steps):
            idx = sampler.next_batch(8)
            torch.nn.functional.cross_entropy(ddp(data[idx]), target[idx]).backward()
            opt.step()
            opt.zero_grad()
            opt.flush()
            out.write(f"{step + 1} {state_digest(model, opt, sched, sampler)} {shared_digest(model, opt)}\n")
            out.flush()
            if args.crash_at == step + 1 and args.rank in args.crash_ranks:
                os.kill(os.getpid(), signal.SIGKILL)
    opt.close()
    if args.world > 1:
        dist.destroy_process_group()
    end_process()   # inside main(): partition_worker.end_process says why


if __name__ == "__main__":
    main()
