"""Recovery time: lowdiff's resume against the naive recovery of the published LowDiff code and the
physical lower bound, measured in one run on one disk; and full-checkpoint load against DCP.

One directory holds a full checkpoint at step 0 and CHAIN differentials (TopK, batch 10) of a
GPT-2-style model trained with AdamW (gradients are synthetic: recovery cost does not depend on
where a gradient came from). Measured, page cache dropped before each recovery (root), each
recovery in a new process (as after a failure):

  naive        the full state and each differential saved with torch.save, recovered with
               torch.load, one differential loaded and applied at a time
  resume-w1    recovery.resume(workers=1)
  resume       recovery.resume() (default workers)
  naive-kept   the naive recovery with its optimizer steps where resume's replay runs its own:
               recovery.pipeline.heapreuse.keep_freed_memory (how much of resume's gain that alone gives)
  lower-bound  all checkpoint bytes at the O_DIRECT read bandwidth of those very files (read before
               the recoveries, before each resume round and after them; the fastest pass counts,
               and each round is also set against its own pass) + the time of the
               replay's optimizer steps themselves: the fastest of their three timings in this
               run (inside the naive recovery, inside naive-kept, inside the default resume;
               same gradients, same optimizer state)
  full-load    lowdiff's full-checkpoint load (read + verify) against an O_DIRECT read of the same file
               by the same engine (queue depth, chunks) into memory already faulted in (the device's
               speed) and into new memory, interleaved rounds (each case in a new process) with CPU
               time and page faults; the load into a model with a fresh AdamW (the optimizer's state
               must be made) and with an AdamW that has state (a process that trained: it can be
               written in place), each against torch.distributed.checkpoint's documented load
               (get_state_dict, dcp.load, set_state_dict) into the same objects

Then recovery time versus chain length (time travel: resume(step=K) on the same directory) with the
read / decode / apply split. Prints tables and ratios; --csv writes the rows.

    python experiments/bench_recovery.py                       # gpt2-124m, chain 200 (slow on a CPU)
    python experiments/bench_recovery.py --model quick --chain 40 --lengths 0,20,40
    python experiments/bench_recovery.py --full-load-only              # the full-checkpoint load table alone

The load average (os.getloadavg) is printed with every table: this machine is shared.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import functools
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import build_model  # noqa: E402

import fastio  # noqa: E402
import lowdiff  # noqa: E402
import recovery  # noqa: E402
from lowdiff.format.fullckpt import live_targets, load_full  # noqa: E402
from recovery.pipeline.heapreuse import keep_freed_memory  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache (root only); False when it could not."""
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def synthetic_grads(params: list, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-2


def make_run(directory: str, naive_dir: str, model_name: str, chain: int, ratio: float | None):
    """Train ``chain`` steps with lowdiff (full at 0, TopK differentials in batches of 10) and save
    the naive baseline's files at the same time."""
    model = build_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    compressor = lowdiff.TopK(ratio=ratio) if ratio else lowdiff.Dense()
    wrapped = lowdiff.wrap(opt, model, directory, compressor=compressor, full_every=10 ** 9, batch_steps=10,
                           retention=lowdiff.KeepLast(4))
    recovery.resume(directory, model, wrapped)
    for step in range(chain):
        synthetic_grads(params, step)
        if step == 0:  # AdamW creates its state at the first step: save the naive full state before it
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f"{naive_dir}/full.pt")
        wrapped.step()
        # What the optimizer consumed, as the published code stores a differential: sparse per tensor.
        torch.save([(p.grad.reshape(-1).nonzero().reshape(-1), p.grad.reshape(-1)[p.grad.reshape(-1) != 0])
                    if p.grad is not None else None for p in params], f"{naive_dir}/diff-{step + 1}.pt")
        wrapped.zero_grad()
        if (step + 1) % 20 == 0:
            log(f"  trained {step + 1}/{chain} steps")
    wrapped.close()


def optimizer_step_s(model_name: str, repeats: int = 5) -> float:
    """Median time of one plain AdamW step of this model (the replay's unavoidable cost per step)."""
    model = build_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    times = []
    for step in range(repeats + 1):
        synthetic_grads(params, step)
        started = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - started)
    return sorted(times[1:])[repeats // 2]   # the first step creates the state


def naive_recovery(naive_dir: str, model_name: str, chain: int, keep_memory: bool = False) -> tuple[float, float]:
    """(seconds of the whole naive recovery, seconds inside its optimizer steps). The second is
    the replay's unavoidable work: the same optimizer steps on the same gradients and state (AdamW
    on a state that sparse gradients left mostly zero is slower than on a dense one, so a step
    timed on random dense gradients would misstate it). ``keep_memory``: inside
    recovery.pipeline.heapreuse.keep_freed_memory, as resume's replay runs its steps (what the naive
    recovery would gain from that alone)."""
    with keep_freed_memory() if keep_memory else contextlib.nullcontext():
        return _naive_recovery(naive_dir, model_name, chain)


def _naive_recovery(naive_dir: str, model_name: str, chain: int) -> tuple[float, float]:
    model = build_model(model_name, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())
    stepping = 0.0
    started = time.perf_counter()
    state = torch.load(f"{naive_dir}/full.pt", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    for step in range(1, chain + 1):
        diff = torch.load(f"{naive_dir}/diff-{step}.pt", weights_only=True)
        for p, entry in zip(params, diff):
            if entry is None:
                p.grad = None
                continue
            p.grad = torch.zeros_like(p)
            p.grad.view(-1)[entry[0]] = entry[1]
        step_started = time.perf_counter()
        opt.step()
        stepping += time.perf_counter() - step_started
    return time.perf_counter() - started, stepping


SPLIT = ("load_s", "read_s", "decode_s", "apply_s")   # where a resume's time went (recovery.Resumed)


def timed_resume(directory: str, model_name: str, **options) -> dict:
    """One resume in this process: its seconds, the step it reached, its read / decode / apply
    split and the seconds inside the optimizer's own steps (``opt_steps_s``)."""
    model = build_model(model_name, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    inner_step, stepping = opt.step, [0.0]

    def timed_step(*args, **kwargs):   # the replay calls optimizer.step() on this very object
        started = time.perf_counter()
        try:
            return inner_step(*args, **kwargs)
        finally:
            stepping[0] += time.perf_counter() - started
    opt.step = timed_step
    started = time.perf_counter()
    result = recovery.resume(directory, model, opt, **options)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "step": int(result), "opt_steps_s": stepping[0],
            **{k: getattr(result, k) for k in SPLIT}}


def in_new_process(function: str, *args, **kwargs):
    """``function(*args, **kwargs)`` of this module, run in a new interpreter; its JSON result.
    Every recovery is timed in its own process, as one after a failure runs: in a process that
    has recovered before, what the earlier recoveries allocated and freed decides where the next
    one's memory comes from, and so how fast its optimizer steps run (measured 2x apart)."""
    code = (f"import sys, json; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import torch; torch.set_num_threads({torch.get_num_threads()}); import bench_recovery; "
            f"print(json.dumps(bench_recovery.{function}(*{args!r}, **{kwargs!r})))")
    out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


RESUMES = (("resume workers=1", {"workers": 1}), ("resume (default)", {}))


def resume_rows(directory: str, args, ckpt_bytes: int, bandwidths: list) -> tuple[list, list]:
    """(one row per entry of RESUMES, [(seconds, read bandwidth of its round)] of the default
    resume). Of ``--resume-rounds`` rounds (the order alternating) a row is the round with the
    median time; its "rounds" column lists every round's seconds. On a shared machine one resume
    can take 1.5x another of the same code: one round decides nothing. Before each round the
    device's read bandwidth over the chain's files is measured again (appended to ``bandwidths``):
    this disk's speed drifts by 2x within an hour, so each round can also be set against the bound
    of its own moment."""
    runs: dict = {name: [] for name, _ in RESUMES}
    default_rounds = []
    for round_ in range(args.resume_rounds):
        bandwidths.append(checkpoint_read_bandwidth(directory))
        for name, options in (RESUMES if round_ % 2 == 0 else RESUMES[::-1]):
            drop_caches()
            result = in_new_process("timed_resume", directory, args.model, **options)
            assert result["step"] == args.chain, result
            seconds = result["seconds"]
            runs[name].append({"method": name, "seconds": seconds, "bytes": ckpt_bytes,
                               **{k: round(result[k], 3) for k in (*SPLIT, "opt_steps_s")},
                               "beyond_steps_s": round(seconds - result["opt_steps_s"], 3)})
            if not options:   # the default resume
                default_rounds.append((seconds, bandwidths[-1]))
            if args.resume_rounds > 1:
                log(f"  resume round {round_ + 1}/{args.resume_rounds}: {name} {seconds:.2f} s")
    rows = []
    for name, _ in RESUMES:
        ordered = sorted(runs[name], key=lambda row: row["seconds"])
        row = dict(ordered[(len(ordered) - 1) // 2])
        row["rounds"] = " ".join(f"{r['seconds']:.2f}" for r in runs[name])
        rows.append(row)
    return rows, default_rounds


def checkpoint_read_bandwidth(directory: str, chunk: int = 256 << 20) -> float:
    """O_DIRECT read bandwidth over the checkpoint's own files (bytes/s), page cache dropped first:
    every file read once through fastio in ``chunk`` requests, the next submitted before the last
    is waited for (the queue never drains). No new writes: a multi-GB write just before a timed
    recovery leaves the device flushing, which once made a full-checkpoint load 10x slower."""
    names = sorted(n for n in os.listdir(directory) if n.startswith(("full-", "diff-")))
    buffers = [fastio.aligned_buffer(chunk, populate=True) for _ in range(2)]
    drop_caches()
    total, started = 0, time.perf_counter()
    for name in names:
        with fastio.Reader(os.path.join(directory, name)) as reader:
            pending = None
            for n, offset in enumerate(range(0, reader.size, chunk)):
                nbytes = min(chunk, reader.size - offset)
                wait = reader.submit_read_into(offset, buffers[n % 2].view(0, nbytes))
                if pending is not None:
                    pending()
                pending = wait
                total += nbytes
            if pending is not None:
                pending()
    return total / (time.perf_counter() - started)


def read_bandwidth(directory: str, nbytes: int) -> float:
    """O_DIRECT read bandwidth of this disk (bytes/s): write ``nbytes`` through fastio, drop the
    cache, read it back in one request (fastio splits it into a deep queue of chunks)."""
    path = os.path.join(directory, "bandwidth.bin")
    buffer = fastio.aligned_buffer(nbytes)
    buffer.view()[:] = os.urandom(1 << 20) * (nbytes >> 20)
    with fastio.Writer(path) as writer:
        writer.write(buffer.view())
    drop_caches()
    started = time.perf_counter()
    with fastio.Reader(path) as reader:
        reader.read_into(0, buffer.view())
    elapsed = time.perf_counter() - started
    os.unlink(path)
    return nbytes / elapsed


def dcp_checkpoint(work: str, model_name: str) -> tuple[str, int]:
    """(path, bytes on disk) of a DCP checkpoint of the model and its AdamW state after one step
    (the state lowdiff's full checkpoint holds), saved as DCP's documentation does: through
    ``get_state_dict``, whose keys ``set_state_dict`` takes back."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # single process, on purpose
    model = build_model(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    synthetic_grads(list(model.parameters()), 0)
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    path = os.path.join(work, "dcp")
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=path)
    return path, sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def dcp_load(path: str, model, opt):
    """DCP's documented load: ``get_state_dict`` (which gives a fresh optimizer state first, by a
    step on zero gradients), ``dcp.load`` into those tensors in place, ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return opt


def table(rows: list, columns: list) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(w) for c, w in zip(columns, widths)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-124m", choices=["gpt2-124m", "quick"])
    parser.add_argument("--chain", type=int, default=200, help="differentials after the full checkpoint")
    parser.add_argument("--ratio", type=float, default=0.01, help="TopK ratio (0: Dense differentials)")
    parser.add_argument("--lengths", default="0,50,100,200", help="chain lengths for the scaling table")
    parser.add_argument("--dir", help="work directory on the disk to measure (default: a temp dir here)")
    parser.add_argument("--csv", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                      "bench_recovery.csv"),
                        help="write the rows here (and the figure next to it; default: experiments/results/)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the full-checkpoint load table")
    parser.add_argument("--resume-rounds", type=int, default=1,
                        help="rounds of the two resume rows (alternating order); each row is its median round")
    parser.add_argument("--full-load-only", action="store_true",
                        help="only the full-checkpoint load table (no chain, no naive recovery)")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    work = tempfile.mkdtemp(prefix="bench-recovery-", dir=args.dir or os.getcwd())
    try:
        return run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, work: str) -> int:
    directory, naive_dir = os.path.join(work, "ckpt"), os.path.join(work, "naive")
    os.makedirs(naive_dir)
    cache = "page cache dropped before each recovery" if drop_caches() else \
        "page cache NOT dropped (not root): reads may come from memory"
    compression = f"TopK {args.ratio}" if args.ratio else "Dense"
    log(f"bench_recovery: {args.model}, chain {args.chain}, {compression}, backend {fastio.backend()}; {cache}")
    if args.full_load_only:
        bandwidth = read_bandwidth(work, 256 << 20)
        full_load_rows(directory, work, args.model, bandwidth, args.repeats, cache.startswith("page cache dropped"))
        return 0
    make_run(directory, naive_dir, args.model, args.chain, args.ratio)
    step_s = optimizer_step_s(args.model)
    ckpt_bytes = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    naive_bytes = sum(os.path.getsize(os.path.join(naive_dir, n)) for n in os.listdir(naive_dir))
    # The device's read bandwidth over these very files: before the recoveries (this pass also lets
    # the device settle after the run's writes), before each resume round and at the end. The
    # fastest pass makes the lower bound (the tighter one).
    bandwidths = [checkpoint_read_bandwidth(directory)]
    log("measuring recoveries ...")
    rows = []
    drop_caches()
    naive_s, steps_s = in_new_process("naive_recovery", naive_dir, args.model, args.chain)
    rows.append({"method": "naive (torch.save/load)", "chain": args.chain, "seconds": naive_s, "bytes": naive_bytes,
                 "opt_steps_s": round(steps_s, 3), "beyond_steps_s": round(naive_s - steps_s, 3)})
    resumes, default_rounds = resume_rows(directory, args, ckpt_bytes, bandwidths)
    rows += resumes
    # The naive recovery again with its steps where resume runs its own (freed memory kept): how
    # much of resume's gain is the allocator's alone, and the fastest timing of these very steps.
    drop_caches()
    kept_s, kept_steps_s = in_new_process("naive_recovery", naive_dir, args.model, args.chain, keep_memory=True)
    rows.append({"method": "naive, freed memory kept", "seconds": kept_s, "bytes": naive_bytes,
                 "opt_steps_s": round(kept_steps_s, 3), "beyond_steps_s": round(kept_s - kept_steps_s, 3)})
    bandwidths.append(checkpoint_read_bandwidth(directory))
    bandwidth = max(bandwidths)
    resume_steps_s = rows[2]["opt_steps_s"]
    # The bound's steps: the fastest of the three timings of these very steps (same gradients,
    # same optimizer state) in this run: inside the naive recovery, the same with freed memory
    # kept, inside the default resume (which overlaps them with its reads).
    fastest_steps_s = min(steps_s, kept_steps_s, resume_steps_s)
    # Each round of the default resume against the bound of its own moment (the read bandwidth
    # measured just before that round).
    paired = sorted(seconds / (ckpt_bytes / round_bandwidth + fastest_steps_s)
                    for seconds, round_bandwidth in default_rounds)
    bound = ckpt_bytes / bandwidth + fastest_steps_s
    rows.append({"method": "lower bound (read at device bw + steps)", "chain": args.chain, "seconds": bound,
                 "bytes": ckpt_bytes})
    default = rows[2]["seconds"]
    for row in rows:
        row["vs resume"] = f"{row['seconds'] / default:.2f}x"
        row["seconds"] = round(row["seconds"], 3)
    print(f"\nrecovery of {args.chain} {compression} differentials, {args.model}, {cache}; "
          f"load average {load_average()}")
    ms_each = 1e3 / args.chain   # seconds of all the chain's steps -> milliseconds per step
    print(f"O_DIRECT read bandwidth over the checkpoint's files {bandwidth / 2**20:.0f} MiB/s, the fastest of "
          f"{len(bandwidths)} passes (before the naive recovery, before each resume round, at the end: "
          f"{' '.join(f'{b / 2**20:.0f}' for b in bandwidths)}); the replay's optimizer steps: inside the naive "
          f"recovery {steps_s * ms_each:.1f} ms each, the same with freed memory kept {kept_steps_s * ms_each:.1f} "
          f"ms, inside the default resume {resume_steps_s * ms_each:.1f} ms (the bound takes the fastest); one "
          f"step on random dense gradients {step_s * 1e3:.1f} ms")
    table(rows, ["method", "seconds", "vs resume", "bytes", "load_s", "read_s", "decode_s", "apply_s", "opt_steps_s",
                 "beyond_steps_s"] + (["rounds"] if args.resume_rounds > 1 else []))
    print(f"naive / resume = {rows[0]['seconds'] / default:.2f} (target >= 3); naive with freed memory kept / "
          f"resume = {kept_s / default:.2f}; resume / lower bound = {default / bound:.2f} (target <= 1.2); "
          f"time beyond the optimizer's own steps: naive {rows[0]['beyond_steps_s']} s, resume "
          f"{rows[2]['beyond_steps_s']} s "
          f"({rows[0]['beyond_steps_s'] / max(rows[2]['beyond_steps_s'], 1e-9):.1f}x less)")
    print(f"default resume / the bound of its own round (that round's read bandwidth): "
          f"{' '.join(f'{r:.2f}' for r in paired)} (median {paired[(len(paired) - 1) // 2]:.2f})")
    # Any exact recovery runs every recorded optimizer step, so no method can beat the naive one by
    # more than naive / lower bound: when the steps dominate (large model, CPU optimizer) the
    # "3x" target is out of reach for every method, and the bound shows by how much.
    print(f"the most any exact recovery could gain over naive here: naive / lower bound = "
          f"{rows[0]['seconds'] / bound:.2f}")
    rows += full_load_rows(directory, work, args.model, bandwidth, args.repeats, cache.startswith("page cache dropped"))
    rows += scaling_rows(directory, args)
    if args.csv:
        os.makedirs(os.path.dirname(os.path.abspath(args.csv)), exist_ok=True)
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
            writer.writeheader()
            writer.writerows(rows)
        import plotting  # experiments/plotting.py: the figure, drawn from the CSV alone
        print(plotting.try_draw(args.csv))
    return 0


def full_with_optimizer_state(work: str, model_name: str) -> str:
    """A lowdiff full checkpoint of the model and its AdamW state after one step (the chain's own
    full checkpoint is taken before AdamW has state)."""
    directory = os.path.join(work, "full1")
    model = build_model(model_name)
    opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-4), model, directory, full_every=1)
    synthetic_grads(list(model.parameters()), 0)
    opt.step()
    opt.close()
    return next(os.path.join(directory, n) for n in sorted(os.listdir(directory)) if n.startswith("full-000000000001"))


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measured(fn, cache: bool) -> tuple[float, float, int]:
    """(seconds, process CPU seconds, minor page faults) of ``fn()``, page cache dropped first
    (``cache``: drop_caches worked). CPU and faults include every thread of the process (the
    fastio ring's thread takes the destination's page faults inside io_uring_enter)."""
    if cache:
        drop_caches()
    before = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    del result   # freeing gigabytes (munmap) is not part of a load: it was timed before
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    return elapsed, cpu, after.ru_minflt - before.ru_minflt


def _read_into(path: str, size: int, buffer):
    with fastio.Reader(path) as reader:
        reader.read_into(0, buffer.view(0, size))
    return buffer


# The full-load cases, each named once. Bytes only: (path, size) -> the function timed.
_BYTE_CASES = {
    "device read, prefaulted memory":
        lambda path, size: functools.partial(_read_into, path, size, fastio.aligned_buffer(size, populate=True)),
    "populate new memory alone": lambda path, size: functools.partial(fastio.aligned_buffer, size, populate=True),
    "device read, fresh memory": lambda path, size: lambda: _read_into(path, size, fastio.aligned_buffer(size)),
    "lowdiff load_full (read + verify)": lambda path, size: functools.partial(load_full, path),
}
# Into a model + AdamW: (whose load, whether the optimizer has state before it). A process that has
# trained (or initialised its optimizer's state) has it, and a load can write it in place; a fresh
# AdamW's state comes from the file. DCP always loads into existing tensors.
_INTO_MODEL_CASES = {
    "lowdiff into model + fresh AdamW": ("lowdiff", False),
    "DCP into model + fresh AdamW": ("dcp", False),
    "lowdiff into model + AdamW with state": ("lowdiff", True),
    "DCP into model + AdamW with state": ("dcp", True),
}
FULL_LOAD_CASES = (*_BYTE_CASES, *_INTO_MODEL_CASES)


def full_load_case(path: str, dcp_path: str, model_name: str, name: str):
    """The function timed as case ``name``, with what it needs made first (untimed), each with the
    page cache dropped: the same file's bytes read by one fastio O_DIRECT request (the engine's
    chunking and queue depth, as load_full uses) into memory that is already faulted in (the
    device's speed) and into new memory (what any loader that creates the state pays for
    first-touch page faults); new memory populated alone (MAP_POPULATE: the machine's rate of
    making pages, the bound of any load into new memory); load_full; load_full into a live model
    + AdamW; DCP's load into the same objects. It returns what it made, freed after the clock
    stops."""
    if name in _BYTE_CASES:
        return _BYTE_CASES[name](path, os.path.getsize(path) // 4096 * 4096)
    loader, with_state = _INTO_MODEL_CASES[name]

    def into_live(model, opt):
        # As resume does: the model's tensors (and the optimizer's, if it has state) are read
        # straight into them, the rest into new memory the optimizer adopts.
        _, state = load_full(path, into=live_targets(model, opt))
        model.load_state_dict(state.model)
        opt.load_state_dict(state.optimizer)
        return opt

    load = into_live if loader == "lowdiff" else functools.partial(dcp_load, dcp_path)
    model = build_model(model_name, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if with_state:
        synthetic_grads(list(model.parameters()), 1)
        opt.step()
    return lambda: load(model, opt)


def measured_case(path: str, dcp_path: str, model_name: str, name: str, cache: bool) -> tuple:
    """(seconds, CPU seconds, minor page faults) of one full-load case in this process."""
    # DCP warns, in every process, that it loads without a process group: as intended here.
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    return measured(full_load_case(path, dcp_path, model_name, name), cache)


def full_load_rows(directory: str, work: str, model_name: str, bandwidth: float, repeats: int, cache: bool) -> list:
    log("full-checkpoint load vs DCP ...")
    full = full_with_optimizer_state(work, model_name)
    size = os.path.getsize(full)
    dcp_path, dcp_bytes = dcp_checkpoint(work, model_name)
    times: dict = {name: [] for name in FULL_LOAD_CASES}
    for round_ in range(repeats):   # interleaved: a shared machine's load drifts alike for every case
        log(f"  round {round_ + 1}/{repeats}")
        for name in FULL_LOAD_CASES:   # each in a new process, as a recovery after a failure
            times[name].append(in_new_process("measured_case", full, dcp_path, model_name, name, cache))
    device_s = statistics.median(t for t, _, _ in times["device read, prefaulted memory"])
    rows = []
    for name, runs in times.items():
        seconds = statistics.median(t for t, _, _ in runs)
        nbytes = dcp_bytes if name.startswith("DCP") else size
        rows.append({"method": name, "seconds": round(seconds, 3), "bytes": nbytes,
                     "of device bw": f"{nbytes / seconds / (size / device_s):.2f}",
                     "cpu_s": round(statistics.median(c for _, c, _ in runs), 2),
                     "page_faults": int(statistics.median(f for _, _, f in runs))})
    by_name = {row["method"]: float(row["seconds"]) for row in rows}
    ours, fresh, populate = (by_name[n] for n in (
        "lowdiff load_full (read + verify)", "device read, fresh memory", "populate new memory alone"))
    # A load that creates the state needs its memory: no loader into new memory beats the slower of
    # reading the bytes and populating the pages, whichever this machine makes the bottleneck.
    new_memory_bound = max(device_s, populate)
    print(f"\nfull-checkpoint load, {size / 2**20:.0f} MiB, median of {repeats} interleaved rounds, "
          f"{'page cache dropped before each' if cache else 'page cache NOT dropped'}; load average {load_average()}")
    table(rows, ["method", "seconds", "bytes", "of device bw", "cpu_s", "page_faults"])
    with_state = by_name["lowdiff into model + AdamW with state"]
    print(f"device read of this file {size / device_s / 2**30:.2f} GiB/s (the read bandwidth measured earlier "
          f"in this run: "
          f"{bandwidth / 2**30:.2f} GiB/s); lowdiff load_full at {device_s / ours:.2f} of the device's read bandwidth, "
          f"into a model + AdamW with state at {device_s / with_state:.2f} (target >= 0.9); load_full at "
          f"{fresh / ours:.2f} of a bare read into fresh memory")
    print(f"lowdiff / DCP time: into a fresh AdamW "
          f"{by_name['lowdiff into model + fresh AdamW'] / by_name['DCP into model + fresh AdamW']:.2f}, "
          f"into an AdamW with state {with_state / by_name['DCP into model + AdamW with state']:.2f} (target < 1)")
    print(f"new memory populates at {size / populate / 2**30:.2f} GiB/s here: a load into new memory takes at least "
          f"{new_memory_bound:.3f} s ({'populating' if populate > device_s else 'reading'} is the bottleneck); "
          f"load_full at {new_memory_bound / ours:.2f} of that bound")
    return rows


def scaling_rows(directory: str, args) -> list:
    log("recovery time versus chain length ...")
    rows = []
    for length in [int(v) for v in args.lengths.split(",") if int(v) <= args.chain]:
        drop_caches()
        result = in_new_process("timed_resume", directory, args.model, step=length)
        rows.append({"method": f"resume step={length}", "chain": length, "seconds": round(result["seconds"], 3),
                     **{k: round(result[k], 3) for k in SPLIT}})
    print(f"\nrecovery time versus chain length (time travel on one directory); load average {load_average()}")
    table(rows, ["chain", "seconds", "load_s", "read_s", "decode_s", "apply_s"])
    return rows


if __name__ == "__main__":
    sys.exit(main())
