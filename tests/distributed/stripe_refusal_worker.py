"""One rank of a 2-rank gloo run that wraps DDP training with Options(stripe_dirs=...): prints one
JSON line {"error", "message", "written"} (what wrap raised, and whether anything appeared in the
checkpoint or stripe directories). Used by test_stripe_refusal.py."""
import argparse
import json
import os

import torch
import torch.distributed as dist

import lowdiff


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int)
    parser.add_argument("--world", type=int)
    parser.add_argument("--port", type=int)
    parser.add_argument("--dir")
    args = parser.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    drive = os.path.join(args.dir, "nvme1")
    error = message = None
    try:
        lowdiff.wrap(opt, model, os.path.join(args.dir, "ckpt"), options=lowdiff.Options(stripe_dirs=(drive,)))
    except ValueError as exc:
        error, message = type(exc).__name__, str(exc)
    dist.barrier()   # both ranks got here: nobody waits in a collective wrap started
    written = os.path.exists(drive) or os.path.exists(os.path.join(args.dir, "ckpt", "MANIFEST.json"))
    print(json.dumps({"error": error, "message": message, "written": written}), flush=True)
    dist.destroy_process_group()
    os._exit(0)   # torch 2.13 + gloo abort at interpreter exit


if __name__ == "__main__":
    main()
