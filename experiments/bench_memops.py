"""What checksumming costs next to copying: fastio's copy and CRC paths against memcpy, one run.

A full checkpoint is copied into staging off the training thread and every tensor's CRC-32C is
computed in the same pass (fastio.copy_regions(..., checksums=True)); on a machine whose cores
all train, that CPU time is what the iterations pay (issue #32). This prints, for a buffer of
``--mib`` MiB already in memory (pages touched), the median time and bandwidth of:

  memcpy            fastio.copy_regions, one thread, no checksum (the floor)
  copy + CRC-32C    the same with each 256 KiB piece checksummed while in cache
  CRC-32C           fastio.crc32c, the backend this CPU runs (crc32c_backend())
  CRC-32C sse4.2    the crc32 instruction alone, three streams (the path before AVX-512 folding)
  CRC-32C table     the portable slicing-by-8 path (machines without SSE4.2)
  CRC-32 (zlib's)   fastio.crc32, carry-less folding, and zlib.crc32 itself (step records)
  torch copy_       Tensor.copy_ of the same bytes (torch's intra-op threads)

each as a ratio to memcpy measured in the same rounds (the methods take turns, so drift hits
them alike). Timing only; tests never run this.

Usage: python experiments/bench_memops.py [--mib 60] [--rounds 15]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib

import numpy as np
import torch

import fastio
from fastio._memops import crc32c_backend, crc32c_software, crc32c_sse42


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=60)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    nbytes = args.mib << 20
    source = torch.from_numpy(np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8))
    staging = fastio.aligned_buffer(nbytes, populate=True)
    target = staging.tensor(nbytes)
    src, dst = source.data_ptr(), target.data_ptr()
    raw = source.numpy().data   # a memoryview, for zlib
    methods = {
        "memcpy": lambda: fastio.copy_regions([dst], [src], [nbytes]),
        "copy + CRC-32C": lambda: fastio.copy_regions([dst], [src], [nbytes], checksums=True),
        f"CRC-32C ({crc32c_backend()})": lambda: fastio.crc32c(source.numpy()),
        "CRC-32C sse4.2": lambda: crc32c_sse42(source.numpy()),
        "CRC-32C table": lambda: crc32c_software(source.numpy()),
        "CRC-32 fastio": lambda: fastio.crc32(source.numpy()),
        "CRC-32 zlib": lambda: zlib.crc32(raw),
        "torch copy_": lambda: target.copy_(source),
    }
    for run in methods.values():   # warm: code paths and caches, once each
        run()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for round_ in range(args.rounds):
        names = list(methods)
        names = names[round_ % len(names):] + names[:round_ % len(names)]   # rotate who goes first
        for name in names:
            started = time.perf_counter()
            methods[name]()
            times[name].append(time.perf_counter() - started)
        print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
    copy = statistics.median(times["memcpy"])
    print(f"{args.mib} MiB, {args.rounds} rounds, torch threads {torch.get_num_threads()}, "
          f"crc32c backend {crc32c_backend()}")
    print(f"{'method':<24}{'ms':>9}{'GB/s':>9}{'x memcpy':>10}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<24}{median * 1e3:>9.2f}{nbytes / median / 1e9:>9.1f}{median / copy:>10.2f}")
    fused = statistics.median(times["copy + CRC-32C"]) / copy
    print(f"copy with its checksum costs {fused:.2f} memcpys on this CPU")


if __name__ == "__main__":
    main()
