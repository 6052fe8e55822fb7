"""Question: does fastio persist a tensor at the disk's O_DIRECT write speed, and how does it compare
with torch.save and a plain buffered write on the same disk, in the same run?

Every write is timed from opening the file to the end of its fdatasync/fsync (fastio: to the end of
commit: fdatasync, rename, directory fsync). Baselines measured here, interleaved with the fastio
runs (one round of every method per repeat, median of --repeat rounds):

  fastio[uring] zero-copy   Writer(engine=uring) writing a float32 tensor living in fastio.aligned_buffer
  fastio[uring] staged      the same from an ordinary torch tensor (not page-aligned: copied to staging)
  fastio[pwrite] ...        the same two on the pwrite thread-pool backend
  torch.save+fsync          torch.save to an open file, flush, os.fsync
  python write+fsync        open/write/flush/os.fsync of the tensor's bytes
  device O_DIRECT QD32      device limit: one pre-filled aligned buffer written sequentially with
                            O_DIRECT, 4 MiB requests, 32 in flight, through the raw fastio._uring.Ring
                            (or 32 pwrite threads where the extension is missing), then fdatasync
  fio                       if installed: fio --direct=1 --rw=write --bs=4m --iodepth=32 --ioengine=io_uring

Also: the bandwidth of copying an ordinary tensor into aligned staging memory versus a plain memcpy
between two preallocated, pre-faulted arrays.

Usage: python experiments/bench_write.py --sizes 64MiB,256MiB,1GiB --repeat 3
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import fastio  # noqa: E402
from fastio._select import uring_available  # noqa: E402

ALIGN = fastio.ALIGN_BYTES
DEVICE_CHUNK_BYTES = 4 << 20
DEVICE_QUEUE_DEPTH = 32
UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "K": 1 << 10, "M": 1 << 20,
         "G": 1 << 30, "KB": 1000, "MB": 1000 ** 2, "GB": 1000 ** 3}
TARGET_MIN_BYTES = 256 << 20
TARGET_VS_DEVICE = 0.90
TARGET_VS_TORCH = 1.3
TARGET_COPY_VS_MEMCPY = 0.8

DEVICE = "device O_DIRECT QD32"
TORCH_SAVE = "torch.save+fsync"
MEMCPY = "memcpy (np.copyto)"


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- arguments
def parse_size(text: str) -> int:
    text = text.strip()
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = text[len(digits):].upper()
    if unit not in UNITS or not digits:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected a number and a unit such as 64MiB or 1GiB")
    nbytes = int(float(digits) * UNITS[unit])
    if nbytes <= 0 or nbytes % ALIGN:
        raise argparse.ArgumentTypeError(f"size {text!r} = {nbytes} bytes must be a positive multiple of {ALIGN}")
    return nbytes


def parse_sizes(text: str) -> list[int]:
    return [parse_size(part) for part in text.split(",") if part.strip()]


def human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B"


def filesystem_of(path: str) -> tuple[str, str]:
    """(mount point, filesystem type) of ``path``, from /proc/mounts (longest matching prefix)."""
    path = os.path.realpath(path)
    best = ("/", "unknown")
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                fields = line.split()
                mount_point, fs_type = fields[1], fields[2]
                inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
                if inside and len(mount_point) >= len(best[0]):
                    best = (mount_point, fs_type)
    except OSError:
        pass
    return best


def default_dir() -> str:
    """A scratch directory inside the repository: on the real disk (never /tmp, which may be tmpfs)."""
    return os.path.join(REPO_ROOT, "experiments", "results", "bench_write_tmp")


# ----------------------------------------------------------------------------- methods
class Context:
    """Engines, the source tensors of the current size, and the scratch directory."""

    def __init__(self, directory: str, engines: dict):
        self.directory = directory
        self.engines = engines
        self.counter = 0
        self.aligned = None      # fastio.AlignedBuffer of the current size
        self.aligned_tensor = None
        self.ordinary = None     # an ordinary torch tensor (not page-aligned)

    def fresh_path(self, tag: str) -> str:
        self.counter += 1
        return os.path.join(self.directory, f"bench-{self.counter:05d}-{tag}.bin")


def remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fastio_method(backend_name: str, zero_copy: bool):
    def run(ctx: Context, nbytes: int) -> float:
        engine = ctx.engines[backend_name]
        tensor = ctx.aligned_tensor if zero_copy else ctx.ordinary
        path = ctx.fresh_path(f"fastio-{backend_name}")
        start = time.perf_counter()
        with fastio.Writer(path, engine=engine) as writer:
            writer.write(tensor)
        seconds = time.perf_counter() - start
        if os.path.getsize(path) != nbytes:
            raise RuntimeError(f"{path}: wrote {os.path.getsize(path)} bytes, expected {nbytes}")
        remove(path)
        return seconds
    return run


def torch_save(ctx: Context, nbytes: int) -> float:
    path = ctx.fresh_path("torch-save")
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(ctx.ordinary, f)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    remove(path)
    return seconds


def python_write(ctx: Context, nbytes: int) -> float:
    path = ctx.fresh_path("python-write")
    data = memoryview(ctx.ordinary.numpy()).cast("B")
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - start
    remove(path)
    return seconds


def _device_write_uring(fd: int, view: memoryview, nbytes: int) -> None:
    from fastio import _uring

    with _uring.Ring(DEVICE_QUEUE_DEPTH) as ring:
        pending = [(offset, min(DEVICE_CHUNK_BYTES, nbytes - offset))
                   for offset in range(0, nbytes, DEVICE_CHUNK_BYTES)]
        pending.reverse()  # pop() from the end takes the lowest offset first
        inflight: dict[int, int] = {}
        while pending or inflight:
            while pending and len(inflight) < DEVICE_QUEUE_DEPTH:
                offset, length = pending[-1]
                if not ring.prep("write", fd, view[offset:offset + length], offset, offset):
                    break
                pending.pop()
                inflight[offset] = length
            ring.submit_and_wait(1)
            for offset, res in ring.reap():
                length = inflight.pop(offset)
                if res < 0:
                    raise OSError(-res, f"io_uring write of {length} bytes at offset {offset} failed: "
                                        f"{os.strerror(-res)}")
                if res < length:  # short write: queue the rest
                    pending.append((offset + res, length - res))


def _device_write_threads(fd: int, view: memoryview, nbytes: int) -> None:
    def one(offset: int) -> None:
        chunk = view[offset:offset + min(DEVICE_CHUNK_BYTES, nbytes - offset)]
        done = 0
        while done < chunk.nbytes:
            done += os.pwrite(fd, chunk[done:], offset + done)

    with ThreadPoolExecutor(DEVICE_QUEUE_DEPTH) as pool:
        list(pool.map(one, range(0, nbytes, DEVICE_CHUNK_BYTES)))


def device_limit(use_ring: bool):
    def run(ctx: Context, nbytes: int) -> float:
        path = ctx.fresh_path("device")
        view = ctx.aligned.view(0, nbytes)
        start = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC, 0o644)
        try:
            (_device_write_uring if use_ring else _device_write_threads)(fd, view, nbytes)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        seconds = time.perf_counter() - start
        remove(path)
        return seconds
    return run


def fio_method(ctx: Context, nbytes: int) -> float:
    """fio's own measurement, converted to seconds for ``nbytes``."""
    path = ctx.fresh_path("fio")
    command = ["fio", "--name=bench_write", f"--filename={path}", "--direct=1", "--rw=write", "--bs=4m",
               f"--iodepth={DEVICE_QUEUE_DEPTH}", "--ioengine=io_uring", f"--size={nbytes}",
               "--end_fsync=1", "--output-format=json"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=True)
    finally:
        remove(path)
    report = json.loads(result.stdout[result.stdout.index("{"):])
    bytes_per_s = report["jobs"][0]["write"]["bw_bytes"]
    return nbytes / bytes_per_s


# ----------------------------------------------------------------------------- copy bandwidth
def copy_bandwidths(ctx: Context, nbytes: int, repeat: int) -> dict[str, float]:
    """GB/s of: memcpy between pre-faulted arrays; copy-in of the ordinary tensor into reused
    (pre-faulted) aligned staging; copy-in into freshly allocated aligned staging (page faults)."""
    source = ctx.ordinary.numpy().view(np.uint8).reshape(-1)
    target = np.empty(nbytes, dtype=np.uint8)
    target.fill(1)  # fault the pages in
    staging = fastio.aligned_buffer(nbytes)
    staging.numpy().fill(1)
    results: dict[str, list[float]] = {MEMCPY: [], "copy-in staging (reused)": [],
                                       "copy-in staging (fresh)": [], "torch copy_ (reused staging)": []}
    for _ in range(repeat):
        start = time.perf_counter()
        np.copyto(target, source)
        results[MEMCPY].append(time.perf_counter() - start)

        start = time.perf_counter()
        np.copyto(staging.numpy(), source)
        results["copy-in staging (reused)"].append(time.perf_counter() - start)

        start = time.perf_counter()
        fresh = fastio.aligned_buffer(nbytes)
        np.copyto(fresh.numpy(), source)
        results["copy-in staging (fresh)"].append(time.perf_counter() - start)
        del fresh

        start = time.perf_counter()
        staging.tensor().view(torch.float32).copy_(ctx.ordinary)
        results["torch copy_ (reused staging)"].append(time.perf_counter() - start)
    if not np.array_equal(staging.numpy()[:4096], source[:4096]):
        raise RuntimeError("staging copy produced different bytes")
    return {name: nbytes / statistics.median(times) / 1e9 for name, times in results.items()}


# ----------------------------------------------------------------------------- main
def build_methods(engines: dict, use_ring: bool, have_fio: bool) -> dict:
    methods = {}
    for name in ("uring", "pwrite"):
        if name in engines:
            methods[f"fastio[{name}] zero-copy"] = fastio_method(name, zero_copy=True)
            methods[f"fastio[{name}] staged"] = fastio_method(name, zero_copy=False)
    methods[TORCH_SAVE] = torch_save
    methods["python write+fsync"] = python_write
    methods[DEVICE] = device_limit(use_ring)
    if have_fio:
        methods["fio (io_uring QD32 bs4m)"] = fio_method
    return methods


def prepare_sources(ctx: Context, nbytes: int, rng: np.random.Generator) -> None:
    ctx.aligned = ctx.aligned_tensor = ctx.ordinary = None
    ordinary = torch.empty(nbytes // 4, dtype=torch.float32)
    if ordinary.data_ptr() % ALIGN == 0:  # by chance page-aligned: shift it so it must be staged
        ordinary = torch.empty(nbytes // 4 + 16, dtype=torch.float32)[16:]
    # Random bytes (not zeros), so no layer below can shortcut the data.
    ordinary.view(torch.uint8).numpy()[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    ctx.ordinary = ordinary
    ctx.aligned = fastio.aligned_buffer(nbytes)
    ctx.aligned.numpy()[:] = ordinary.view(torch.uint8).numpy()
    ctx.aligned_tensor = ctx.aligned.tensor().view(torch.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("64MiB,256MiB,1GiB,2GiB"),
                        help="comma-separated sizes, multiples of 4096 (default: 64MiB,256MiB,1GiB,2GiB)")
    parser.add_argument("--dir", default=None,
                        help="scratch directory on the disk to measure (default: experiments/results/"
                             "bench_write_tmp in this repository; /tmp is avoided as it may be tmpfs)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per size; the median is reported")
    parser.add_argument("--csv", default=os.path.join(REPO_ROOT, "experiments", "results", "bench_write.csv"),
                        help="CSV output path (default: experiments/results/bench_write.csv)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")

    directory = os.path.abspath(args.dir or default_dir())
    os.makedirs(directory, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="run-", dir=directory)
    mount_point, fs_type = filesystem_of(scratch)
    log(f"scratch directory {scratch} on {fs_type} mounted at {mount_point}")
    if fs_type in ("tmpfs", "ramfs", "devtmpfs"):
        log(f"WARNING: {scratch} is on {fs_type} (memory): the ratios say nothing about a disk")
    largest = max(args.sizes)
    free = shutil.disk_usage(scratch).free
    if free < 2 * largest:
        log(f"ERROR: {free} bytes free under {scratch}; need at least {2 * largest}")
        return 2

    engines = {}
    usable, why = uring_available()
    if usable:
        try:
            engines["uring"] = fastio.make_engine(fastio.FastioConfig(backend="uring"))
        except (ImportError, OSError) as exc:
            log(f"skipping fastio[uring]: {exc}")
    else:
        log(f"skipping fastio[uring]: {why}")
    engines["pwrite"] = fastio.make_engine(fastio.FastioConfig(backend="pwrite"))
    use_ring = usable
    have_fio = shutil.which("fio") is not None
    if not have_fio:
        log("fio not installed: skipping the fio baseline")
    log(f"device limit via {'raw fastio._uring.Ring' if use_ring else '32 pwrite threads'}, "
        f"O_DIRECT, {human(DEVICE_CHUNK_BYTES)} requests, queue depth {DEVICE_QUEUE_DEPTH}")

    methods = build_methods(engines, use_ring, have_fio)
    load_start = os.getloadavg()[0]
    ctx = Context(scratch, engines)
    rng = np.random.default_rng(args.seed)
    rows = []        # (size, method, kind, median GB/s, seconds list)
    copies = []      # (size, method, GB/s)
    try:
        for nbytes in args.sizes:
            log(f"[{human(nbytes)}] preparing sources")
            prepare_sources(ctx, nbytes, rng)
            times: dict[str, list[float]] = {name: [] for name in methods}
            log(f"[{human(nbytes)}] warm-up write (not counted)")
            os.sync()
            methods[DEVICE](ctx, nbytes)
            names = list(methods)
            for round_index in range(args.repeat):
                # Rotate the order each round: no method always follows the same predecessor
                # (whose deleted file the filesystem may still be discarding).
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    method = methods[name]
                    os.sync()  # nothing of the previous method still being written back
                    try:
                        seconds = method(ctx, nbytes)
                    except Exception as exc:  # one broken baseline must not end the run
                        log(f"[{human(nbytes)}] {name}: FAILED: {exc!r}")
                        continue
                    times[name].append(seconds)
                    log(f"[{human(nbytes)}] round {round_index + 1}/{args.repeat} {name}: "
                        f"{nbytes / seconds / 1e9:.3f} GB/s")
            for name, seconds in times.items():
                if seconds:
                    rows.append((nbytes, name, nbytes / statistics.median(seconds) / 1e9, seconds))
            log(f"[{human(nbytes)}] copy bandwidth")
            for name, gbps in copy_bandwidths(ctx, nbytes, args.repeat).items():
                copies.append((nbytes, name, gbps))
    finally:
        for engine in engines.values():
            engine.close()
        ctx.aligned = ctx.aligned_tensor = ctx.ordinary = None
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            os.rmdir(directory)  # only if empty (our default directory)
        except OSError:
            pass

    load_end = os.getloadavg()[0]
    if max(load_start, load_end) > 1.5:
        log(f"WARNING: load average {load_start:.1f} at start, {load_end:.1f} at end: other work "
            f"shared the CPUs (and perhaps the disk); the numbers are not clean")
    report(rows, copies, args, fs_type, (load_start, load_end))
    return 0


def report(rows, copies, args, fs_type, loads) -> None:
    by_key = {(size, name): gbps for size, name, gbps, _ in rows}
    print(f"fastio write bandwidth, {fs_type} disk, median of {args.repeat}, including fdatasync/fsync; "
          f"1-min load average {loads[0]:.1f} at start, {loads[1]:.1f} at end")
    header = (f"{'size':>8}  {'method':<28} {'GB/s':>7} {'min-max GB/s':>13} {'x device':>9} "
              f"{'x torch.save':>13}")
    print(header)
    print("-" * len(header))
    for size, name, gbps, seconds in rows:
        device = by_key.get((size, DEVICE))
        torch_gbps = by_key.get((size, TORCH_SAVE))
        vs_device = f"{gbps / device:9.2f}" if device else f"{'-':>9}"
        vs_torch = f"{gbps / torch_gbps:13.2f}" if torch_gbps else f"{'-':>13}"
        spread = f"{size / max(seconds) / 1e9:.2f}-{size / min(seconds) / 1e9:.2f}"
        print(f"{human(size):>8}  {name:<28} {gbps:7.3f} {spread:>13} {vs_device} {vs_torch}")

    copy_by_key = {(size, name): gbps for size, name, gbps in copies}
    print()
    header = f"{'size':>8}  {'copy':<28} {'GB/s':>7} {'x memcpy':>9}"
    print(header)
    print("-" * len(header))
    for size, name, gbps in copies:
        print(f"{human(size):>8}  {name:<28} {gbps:7.3f} {gbps / copy_by_key[(size, MEMCPY)]:9.2f}")

    print()
    print("targets (informational)")
    for size in sorted({size for size, *_ in rows}):
        if size < TARGET_MIN_BYTES:
            continue
        device, torch_gbps = by_key.get((size, DEVICE)), by_key.get((size, TORCH_SAVE))
        for variant in ("zero-copy", "staged"):
            gbps = by_key.get((size, f"fastio[uring] {variant}"))
            if gbps is None:
                print(f"  {human(size):>6} fastio[uring] {variant}: not measured (uring unavailable)")
                continue
            if device:
                ratio = gbps / device
                print(f"  {human(size):>6} fastio[uring] {variant:<9} >= {TARGET_VS_DEVICE:.2f} x device limit: "
                      f"{ratio:.2f}  {'PASS' if ratio >= TARGET_VS_DEVICE else 'MISS'}")
            if torch_gbps:
                ratio = gbps / torch_gbps
                print(f"  {human(size):>6} fastio[uring] {variant:<9} >= {TARGET_VS_TORCH:.2f} x torch.save+fsync: "
                      f"{ratio:.2f}  {'PASS' if ratio >= TARGET_VS_TORCH else 'MISS'}")
    for size in sorted({size for size, *_ in copies}):
        memcpy = copy_by_key[(size, MEMCPY)]
        for name in ("copy-in staging (reused)", "copy-in staging (fresh)"):
            ratio = copy_by_key[(size, name)] / memcpy
            print(f"  {human(size):>6} {name:<25} >= {TARGET_COPY_VS_MEMCPY:.2f} x memcpy: {ratio:.2f}  "
                  f"{'PASS' if ratio >= TARGET_COPY_VS_MEMCPY else 'MISS'}")

    os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["size_bytes", "method", "gb_per_s", "ratio_to_device", "ratio_to_torch_save",
                      "ratio_to_memcpy", "seconds_per_repeat"])
        for size, name, gbps, seconds in rows:
            device = by_key.get((size, DEVICE))
            torch_gbps = by_key.get((size, TORCH_SAVE))
            out.writerow([size, name, f"{gbps:.4f}", f"{gbps / device:.4f}" if device else "",
                          f"{gbps / torch_gbps:.4f}" if torch_gbps else "", "",
                          " ".join(f"{s:.4f}" for s in seconds)])
        for size, name, gbps in copies:
            out.writerow([size, name, f"{gbps:.4f}", "", "", f"{gbps / copy_by_key[(size, MEMCPY)]:.4f}", ""])
    print(f"\nCSV: {args.csv}")
    import plotting  # experiments/plotting.py: the figure, drawn from the CSV alone
    print(plotting.try_draw(args.csv))


if __name__ == "__main__":
    sys.exit(main())
