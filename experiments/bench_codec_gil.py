"""A differential's encoding (the writer thread) and its decoding for replay (a replay worker) on
their own, and beside a thread that makes small torch calls nonstop, as a thread launching GPU
kernels does: what the GIL hand-offs cost them (issue #25).

Each torch, numpy or C call that lets go of the GIL must take it back, and beside a thread that
holds it between short calls it may wait for it each time; so the codec's cost on a GPU machine
grows with its number of calls, not its bytes. On one H100's host a 350M TopK record took the
writer 67 ms to encode and a replay worker 120 ms to decode (docs/measurements.md), against a
fraction of that alone here. CPU only, synthetic gradients in the GPT-2 layout (no model built).

    python experiments/bench_codec_gil.py [--sizes 124m,350m] [--repeats 12]

Prints, per size: encode and decode+prepare, median ms alone and beside the busy thread, the
ratio, and the busy thread's pace meanwhile against its pace alone (what the codec takes from a
launching thread: 1.00 takes nothing). Run it on two commits to compare them (the numbers are this
machine's).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time

import torch

from lowdiff.format.records import Compressed, StepRecord, decode_record, encode_record
from lowdiff.step.apply import GradientBuffers

SIZES = {"124m": (12, 768), "350m": (24, 1024)}   # layers, width (GPT-2 small / medium)


def gpt2_numels(layers: int, width: int, vocab: int = 50257, block: int = 1024) -> list:
    numels = [vocab * width, block * width]
    for _ in range(layers):
        numels += [width, width, width * 3 * width, 3 * width, width * width, width,
                   width, width, width * 4 * width, 4 * width, 4 * width * width, width]
    return numels + [width, width]


def topk_record(numels: list, ratio: float = 0.01, min_numel: int = 4096) -> StepRecord:
    """A TopK(ratio) record as the GPU path hands it over: sorted int32 indices; values and indices
    each back to back in one buffer (DeviceCopy.to_host places them so)."""
    gen = torch.Generator().manual_seed(0)
    counts = [max(1, int(n * ratio)) if n >= min_numel else n for n in numels]
    values = torch.randn(sum(counts), generator=gen).split(counts)
    indices = [torch.randperm(n, generator=gen)[:c].sort().values.to(torch.int32)
               for n, c in zip(numels, counts) if n >= min_numel]
    joined = torch.cat(indices).split([i.numel() for i in indices])
    picked = iter(joined)
    grads = [Compressed("sparse", n, v, next(picked)) if n >= min_numel else Compressed("dense", n, v)
             for n, v in zip(numels, values)]
    return StepRecord(10, False, grads, {"groups_used": [{"lr": 1e-4}], "rng": torch.get_rng_state()})


def decode_and_prepare(copies: list, buffers: GradientBuffers) -> None:
    # A fresh copy of the record each time (decoding an owned buffer may move its bytes), made
    # before the timing: a replay worker reads it from a file, it does not copy it under the GIL.
    buffers.prepare(decode_record(memoryview(copies.pop()), "mem", 0, owned=True))


def busy(stop: threading.Event, calls: list) -> None:
    a = torch.zeros(4)
    started, count = time.perf_counter(), 0
    while not stop.is_set():
        a.add_(1.0)   # a tiny torch call: lets go of the GIL and takes it back, as a kernel launch does
        count += 1
    calls.append(count / (time.perf_counter() - started))


def busy_rate(seconds: float = 1.0) -> float:
    """Calls a second of the busy thread alone (the launching thread's pace without the codec)."""
    stop, calls = threading.Event(), []
    other = threading.Thread(target=busy, args=(stop, calls))
    other.start()
    time.sleep(seconds)
    stop.set()
    other.join()
    return calls[0]


def timed(fn, repeats: int, contended: bool) -> tuple[float, float | None]:
    """Median ms of ``fn`` on a worker thread, alone or beside the busy thread; and the busy
    thread's calls a second meanwhile (None alone)."""
    times: list = []

    def run():
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    stop, calls = threading.Event(), []
    other = threading.Thread(target=busy, args=(stop, calls)) if contended else None
    if other:
        other.start()
    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    stop.set()
    if other:
        other.join()
    return statistics.median(times[1:]) * 1e3, calls[0] if calls else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="124m,350m")
    ap.add_argument("--repeats", type=int, default=12)
    args = ap.parse_args()
    torch.set_num_threads(1)
    alone_rate = busy_rate()
    print(f"busy thread alone: {alone_rate:,.0f} calls/s (the launching thread's pace the codec takes from)")
    print(f"{'size':6} {'part':16} {'tensors':>7} {'alone ms':>9} {'busy ms':>9} {'ratio':>6} {'busy pace':>9}")
    for size in args.sizes.split(","):
        numels = gpt2_numels(*SIZES[size])
        record = topk_record(numels)
        data = b"".join(bytes(b) for b in encode_record(record))
        buffers = GradientBuffers([torch.zeros(n) for n in numels])

        for part in ("encode", "decode+prepare"):
            if part == "encode":
                alone, _ = timed(functools.partial(encode_record, record), args.repeats, False)
                contended, rate = timed(functools.partial(encode_record, record), args.repeats, True)
            else:
                alone, _ = timed(functools.partial(decode_and_prepare, [bytearray(data) for _ in range(args.repeats)],
                                                   buffers), args.repeats, False)
                contended, rate = timed(functools.partial(decode_and_prepare, [bytearray(data) for _ in
                                                                               range(args.repeats)], buffers),
                                        args.repeats, True)
            print(f"{size:6} {part:16} {len(numels):7d} {alone:9.1f} {contended:9.1f} {contended / alone:6.2f} "
                  f"{rate / alone_rate:9.2f}", flush=True)


if __name__ == "__main__":
    main()
