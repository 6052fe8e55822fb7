"""Where lowdiff's time goes on a GPU: the training thread's profile (cProfile) of TopK-every-step
steps and of full-checkpoint steps, the background threads' time per record and per full
checkpoint, and the replay's read/decode/apply split. A diagnostic for issue #25, sized for a short
GPU loan (~1-2 minutes on one H100); ``--cpu`` runs it on tiny sizes here.

    python experiments/gpu_profile.py [--cpu] [--parts topk,full,replay,gil] [--preset 350m]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_check  # noqa: E402  (the models, loop and zstandard set-up of the device check)


def log(msg: str) -> None:
    print(f"[gpu_profile {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def top(profile: cProfile.Profile, n: int = 22) -> str:
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(n)
    text = out.getvalue()
    return text[text.find("   ncalls"):]


class Timed:
    """Wraps ``owner.name`` (a function) and sums its wall time per call (any thread)."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.calls = owner, name, []
        self.original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.calls.append((time.perf_counter() - t0) * 1e3)
        setattr(owner, name, wrapper)

    def restore(self) -> None:
        setattr(self.owner, self.name, self.original)

    def summary(self) -> str:
        if not self.calls:
            return f"{self.name}: not called"
        last = self.calls[-10:]   # after the warm-up (pinned memory allocated, caches filled)
        return (f"{self.name}: {len(self.calls)} calls, median {statistics.median(self.calls):.2f} ms "
                f"(last 10: {statistics.median(last):.2f}), max {max(self.calls):.2f} ms, "
                f"total {sum(self.calls):.1f} ms")


def steps(loop, opt, count: int, profile_from: int | None = None) -> tuple[list, cProfile.Profile]:
    profile = cProfile.Profile()
    times = []
    for s in range(count):
        loop.sync()
        t0 = time.perf_counter()
        loop.forward_backward(s)
        if profile_from is not None and s >= profile_from:
            profile.enable()
        opt.step()
        opt.zero_grad(set_to_none=True)
        profile.disable()
        loop.sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times, profile


def profiled_run(loop, directory: str, steps_count: int, profile_from: int, **wrap_args) -> tuple:
    """Train ``steps_count`` steps wrapped with ``wrap_args`` (TopK), profiling from
    ``profile_from``: (step times, profile, stats)."""
    import lowdiff
    raw = loop.fresh_optimizer()
    opt = lowdiff.wrap(raw, loop.model, directory, compressor=lowdiff.TopK(ratio=gpu_check.TOPK_RATIO), **wrap_args)
    try:
        times, profile = steps(loop, opt, steps_count, profile_from=profile_from)
        stats = opt.stats()
    finally:
        opt.close()
    return times, profile, stats


def part_topk(preset: str, cpu: bool) -> None:
    from lowdiff.capture import devicecopy
    from lowdiff.persist import background
    from lowdiff.step import compress
    loop = gpu_check.Loop(preset, cpu)
    # to_host's parts: the device sort (launches), the pinned allocation and copy enqueue.
    timers = [Timed(background, "encode_record"), Timed(devicecopy.DeviceCopy, "to_host"),
              Timed(devicecopy.DeviceCopy, "sorted_on_device"), Timed(devicecopy.CudaCopyEngine, "copy_to_host"),
              Timed(background.DiffWriter, "put")]   # put: the step waiting for the writer (backpressure)
    if hasattr(compress, "TopK"):
        timers.append(Timed(compress.TopK, "compress"))
    with tempfile.TemporaryDirectory() as work:
        times, profile, _ = profiled_run(loop, work, 50, 38, full_every=100_000, batch_steps=10)
    log(f"topk {preset}: step ms " + " ".join(f"{t:.0f}" for t in times))
    for t in timers:
        log("  " + t.summary())
    print(top(profile), flush=True)


def part_gil(preset: str, cpu: bool) -> None:
    """Whether the differential writer starves for the GIL: lowdiff TopK every step at the default
    switch interval (5 ms) and at shorter ones, against compression alone, in one process. A
    thread that releases the GIL for each torch call (the writer: a few dozen per record) waits up
    to one switch interval to get it back from a training thread that holds it between kernel
    launches; a writer slower than the steps then holds ``step()`` back (its ``put`` waits)."""
    import lowdiff
    from lowdiff.persist import background
    loop = gpu_check.Loop(preset, cpu)
    warm, timed = (2, 6) if cpu else (35, 12)
    with tempfile.TemporaryDirectory() as work:
        base = gpu_check._time_config(loop, "topk-only", Path(work), warm, timed, lowdiff)
    log(f"gil {preset}: compression alone, median step {statistics.median(base):.1f} ms")
    default = sys.getswitchinterval()
    for interval in (default, 0.001, 0.0002):
        timers = [Timed(background, "encode_record"), Timed(background.DiffWriter, "put")]
        sys.setswitchinterval(interval)
        try:
            with tempfile.TemporaryDirectory() as work:
                times = gpu_check._time_config(loop, "lowdiff-topk", Path(work), warm, timed, lowdiff)
        finally:
            sys.setswitchinterval(default)
            for t in timers:
                t.restore()
        log(f"gil {preset} switch interval {interval * 1e3:.1f} ms: median step {statistics.median(times):.1f} ms "
            f"({statistics.median(times) / statistics.median(base):.3f}x compression alone)")
        for t in timers:
            log("  " + t.summary())
    # Replay: its decoding threads against the thread that applies (launches the optimizer's kernels).
    import recovery
    with tempfile.TemporaryDirectory() as work:
        gpu_check._train_recorded(loop, Path(work) / "rec", 6 if cpu else 20, lowdiff)
        for interval in (default, 0.0002):
            sys.setswitchinterval(interval)
            try:
                fresh = loop.fresh_optimizer()
                loop.sync()
                t0 = time.perf_counter()
                resumed = recovery.resume(str(Path(work) / "rec"), loop.model, fresh)
                loop.sync()
                wall = (time.perf_counter() - t0) * 1e3
            finally:
                sys.setswitchinterval(default)
            log(f"gil {preset} resume at switch interval {interval * 1e3:.1f} ms: {wall:.0f} ms for {resumed.replayed} "
                f"records; load {resumed.load_s * 1e3:.0f} ms, decode {resumed.decode_s * 1e3:.0f} (summed over "
                f"workers), apply {resumed.apply_s * 1e3:.0f}, replay wall {resumed.replay_s * 1e3:.0f} ms")


def part_full(cpu: bool) -> None:
    from lowdiff.format import fullckpt
    from lowdiff.persist import background, pinned
    loop = gpu_check.Loop("124m", cpu)
    timers = [Timed(fullckpt.Snapshot, "copy"), Timed(fullckpt.Snapshot, "persist"),
              Timed(background.FullWriter, "release"), Timed(background.FullWriter, "take"),
              Timed(background.FullWriter, "_quiesce"), Timed(pinned.PinnedStaging, "_drain")]
    with tempfile.TemporaryDirectory() as work:
        times, profile, stats = profiled_run(loop, work, 42, 19, full_every=10, batch_steps=10)
    log("full 124m every 10: step ms " + " ".join(f"{t:.0f}" for t in times))
    log(f"  stats: full_stall_median_ms={stats.get('full_stall_median_ms')}")
    for t in timers:
        log("  " + t.summary())
    print(top(profile), flush=True)


def part_replay(cpu: bool) -> None:
    import lowdiff
    import recovery
    from lowdiff.step import apply
    from recovery.pipeline import devicefeed
    loop = gpu_check.Loop("124m", cpu)
    with tempfile.TemporaryDirectory() as work:
        gpu_check._train_recorded(loop, Path(work) / "rec", 20, lowdiff)
        timers = [Timed(devicefeed.DeviceFeed, "stage"), Timed(apply.GradientBuffers, "apply"),
                  Timed(apply.GradientBuffers, "prepare")]
        fresh = loop.fresh_optimizer()
        loop.sync()
        profile = cProfile.Profile()
        t0 = time.perf_counter()
        profile.enable()
        resumed = recovery.resume(str(Path(work) / "rec"), loop.model, fresh)
        loop.sync()
        profile.disable()
        wall = (time.perf_counter() - t0) * 1e3
    log(f"replay 124m: {resumed.replayed} records in {wall:.0f} ms; load {resumed.load_s * 1e3:.0f} ms, "
        f"read {resumed.read_s * 1e3:.0f}, decode {resumed.decode_s * 1e3:.0f}, apply {resumed.apply_s * 1e3:.0f}, "
        f"replay wall {resumed.replay_s * 1e3:.0f} ms")
    for t in timers:
        log("  " + t.summary())
    print(top(profile), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--parts", default="topk,full,replay,gil")
    ap.add_argument("--preset", default="350m")
    args = ap.parse_args()
    gpu_check.ensure_zstandard()
    if Path(gpu_check.SITE).is_dir():
        sys.path.insert(0, gpu_check.SITE)
    for part in args.parts.split(","):
        t0 = time.perf_counter()
        try:
            if part == "topk":
                part_topk(args.preset, args.cpu)
            elif part == "gil":
                part_gil(args.preset, args.cpu)
            elif part == "full":
                part_full(args.cpu)
            elif part == "replay":
                part_replay(args.cpu)
        except Exception as exc:   # one part failing must not hide the others
            log(f"{part}: FAILED {type(exc).__name__}: {exc}")
        log(f"{part}: {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
