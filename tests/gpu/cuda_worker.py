"""A small training run on CUDA under lowdiff, for tests/gpu/test_cuda_resume.py (run as a script).

After every step it appends "step sha256" to ``--digests``, the hash covering the model, the
optimizer state, the GradScaler, and the CPU and CUDA RNG states byte for byte; with ``--resume``
it first resumes and writes "resumed step sha256". Modes (optimizer, compressor, precision):

  dense        AdamW(fused=True), Dense, fp32
  topk         AdamW (foreach), TopK(0.05), fp32
  sgd          SGD (momentum, nesterov, foreach), TopK(0.05), fp32
  fp16         AdamW (foreach), TopK, autocast fp16 with GradScaler (two steps with inf loss, skipped)
  bf16         AdamW(fused=True), Dense, autocast bf16 (fp32 master weights)
  bf16-params  AdamW (foreach), Dense, parameters in bf16
  replica      AdamW (foreach), Dense, lowdiff.Replica(allow_inexact_gpu=True)

Under torchrun-style environment variables (WORLD_SIZE > 1) it trains DDP: over NCCL, one GPU a
rank, or with ``LOWDIFF_TEST_BACKEND=gloo`` over gloo, where several ranks may share one GPU (NCCL
refuses that): lowdiff's multi-rank path on CUDA tensors on a machine with a single GPU.
"""
from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS, set before torch loads

import argparse  # noqa: E402
import hashlib  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import lowdiff  # noqa: E402
import recovery  # noqa: E402

INF_STEPS = {3, 8}     # fp16: steps whose loss is made infinite (GradScaler skips them)


def build(mode: str, device: torch.device):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                torch.nn.LayerNorm(256), torch.nn.Linear(256, 256), torch.nn.GELU(),
                                torch.nn.Linear(256, 8)).to(device)
    if mode == "bf16-params":
        model = model.to(torch.bfloat16)
    if mode == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=mode in ("dense", "bf16") or None)
    return model, opt


def digest(model, opt, scaler) -> str:
    h = hashlib.sha256()

    def add(t: torch.Tensor) -> None:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")

    for key, value in sorted(model.state_dict().items()):
        h.update(key.encode())
        add(value)
    state = opt.state_dict()
    for index in sorted(state["state"]):
        for key, value in sorted(state["state"][index].items()):
            h.update(f"{index}/{key}".encode())
            add(value) if isinstance(value, torch.Tensor) else h.update(repr(value).encode())
    if scaler is not None:
        h.update(repr(sorted(scaler.state_dict().items())).encode())
    add(torch.get_rng_state())
    add(torch.cuda.get_rng_state())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--mode", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--digests", required=True)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--sleep-s", type=float, default=0.0, help="after each step (gives a killer time)")
    ap.add_argument("--final", help="torch.save the final model state (CPU) here")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    if world > 1:
        backend = os.environ.get("LOWDIFF_TEST_BACKEND", "nccl")
        torch.distributed.init_process_group(backend, rank=rank, world_size=world,
                                             device_id=device if backend == "nccl" else None)
    model, opt = build(args.mode, device)
    trained = model
    if world > 1:
        trained = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    mode = args.mode
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0 ** 12, growth_interval=3) if mode == "fp16" else None
    compressor = lowdiff.TopK(ratio=0.05, min_numel=256) if mode in ("topk", "sgd", "fp16") else lowdiff.Dense()
    schedule = lowdiff.Replica(full_every=4, batch_steps=2, allow_inexact_gpu=True) if mode == "replica" else \
        lowdiff.Fixed(full_every=5, batch_steps=2)
    opt = lowdiff.wrap(opt, trained, args.dir, compressor=compressor, schedule=schedule, grad_scaler=scaler)
    start = 0
    digests = open(f"{args.digests}.{rank}" if world > 1 else args.digests, "a")
    if args.resume:
        start = recovery.resume(args.dir, trained, opt)
        digests.write(f"resumed {start} {digest(model, opt, scaler)}\n")
        digests.flush()
    autocast = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mode)
    for step in range(start, args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(64, 32, generator=g).to(device)
        y = torch.randn(64, 8, generator=g).to(device)
        if mode == "bf16-params":
            x, y = x.to(torch.bfloat16), y.to(torch.bfloat16)
        with torch.autocast("cuda", dtype=autocast, enabled=autocast is not None):
            loss = torch.nn.functional.mse_loss(trained(x).float(), y.float())
        if scaler is not None:
            if step + 1 in INF_STEPS:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
        digests.write(f"{step + 1} {digest(model, opt, scaler)}\n")
        digests.flush()
        if args.sleep_s:
            time.sleep(args.sleep_s)
    opt.close()
    if args.final and rank == 0:
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, args.final)
    digests.close()
    if world > 1:
        torch.distributed.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
