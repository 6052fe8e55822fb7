"""Replaying differentials onto a loaded full checkpoint: records are read, verified, decompressed
and decoded by a pool of worker threads, several ahead of the apply; the caller's thread applies
them strictly in step order.

zstd decompression, CRC and numpy decoding release the GIL, so the workers run in parallel with
each other and with the optimizer math. At most ``window`` records are in flight (memory bound).
The order of application never depends on the number of workers, so ``workers=1`` gives the same
bytes as any other count. A record that fails to verify ends the replay at the step before it (the
valid prefix), which the caller reports; a record of another format version, or any unexpected
error of a worker, is raised in the caller.

The batch files arrive already open (``BatchReader``s): a file that a live trainer's retention
deletes meanwhile stays readable through its open descriptor.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time

import fastio
from lowdiff.errors import CorruptCheckpointError
from lowdiff.step.apply import GradientBuffers, machine_cores, replay_workers
from recovery.pipeline.devicefeed import DeviceFeed
from recovery.pipeline.heapreuse import keep_freed_memory
from recovery.pipeline.progress import Progress


@dataclasses.dataclass
class ReplayTimes:
    """Where replay spent its time, in seconds: reading record bytes and verifying/decoding them
    (summed over the workers, overlapping the apply), and applying them through the optimizer."""

    read_s: float = 0.0
    decode_s: float = 0.0
    apply_s: float = 0.0
    wall_s: float = 0.0        # from the first read to the last apply: what replay added to resume
    records: int = 0
    workers: int = 1
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, read_s: float, decode_s: float) -> None:
        with self._lock:
            self.read_s += read_s
            self.decode_s += decode_s


# Decoding threads of a replay onto a GPU. There the optimizer's step is a few kernel launches and
# the decoders' Python (record metadata, per-tensor views) is what is left to contend for the GIL:
# on one H100's 16-core host, 8 decoders each took 10x their time alone and replay ran no faster
# than serial (docs/measurements.md has the replay time per record by worker count).
GPU_REPLAY_WORKERS = 2
# Records decoded ahead of the apply onto a GPU (WINDOW_BYTES still bounds their bytes). Built
# before the full checkpoint loads, the pipeline decodes this many while it does: at 124M on an H100
# the load took 455 ms and 20 TopK records decoded in about 10 ms each, of which a window of 8
# (4 per worker, the CPU default) left 12 to decode after the load. Device memory is not the bound
# there that a CPU's is.
GPU_REPLAY_WINDOW = 32


def default_workers() -> int:
    """Decoding threads of a replay when none are given (lowdiff.step.apply.replay_workers)."""
    return replay_workers()


def verify_workers() -> int:
    """Checking threads of ``verify`` (nothing is applied): the machine's cores, at most 8."""
    return max(1, min(8, machine_cores()))


def check_workers(workers):
    """``workers`` if it is None or an int >= 1; else ValueError naming it."""
    if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool) or workers < 1):
        raise ValueError(f"workers={workers!r} must be an int >= 1 (or None for the default)")
    return workers


def _tasks(chain: list, first_step: int, stop_step: int | None, warn):
    """(reader, position) of every record to apply, in order; the last item is a
    CorruptCheckpointError when the files do not continue (a gap, a batch shorter than listed)."""
    expected = first_step
    for entry, reader in chain:
        if reader.index_error is not None:
            warn(f"lowdiff: {reader.index_error}; using the {len(reader.entries)} records found by scanning")
        for position, step in enumerate(reader.steps):
            if step < expected:
                continue
            if stop_step is not None and step > stop_step:
                return
            if step != expected:
                yield CorruptCheckpointError(reader.path, f"holds step {step} where step {expected} was expected")
                return
            reader.prepare_read(position)   # here, in step order, on the thread that drives the replay
            yield reader, position
            expected += 1
        if reader.steps and reader.steps[-1] < entry.last and (stop_step is None or reader.steps[-1] < stop_step):
            yield CorruptCheckpointError(reader.path, f"ends at step {reader.steps[-1]} but the manifest "
                                                      f"says {entry.last}")
            return


class _RecordMemory:
    """Page-aligned read buffers reused from record to record. A record is read whole into one
    (through O_DIRECT: its page-aligned span), decoded into views of it, and the buffer comes back
    once the step after it is applied. A dense record is the size of the model: new memory for each
    one would be faulted in and unmapped beside the optimizer's step, which then runs several
    times slower on a small machine; so would the page cache that unaligned reads go through.
    (Not fastio's process-wide StagingPool: it keeps buffers of one exact size, at most 512 MiB in
    all, for Writers; records vary in size, and one dense record is the size of the model.)"""

    def __init__(self):
        self._free: list = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> fastio.AlignedBuffer:
        with self._lock:
            fitting = [i for i, b in enumerate(self._free) if b.capacity_bytes >= nbytes]
            if fitting:
                return self._free.pop(min(fitting, key=lambda i: self._free[i].capacity_bytes))
        return fastio.aligned_buffer(nbytes)

    def give(self, buffer: fastio.AlignedBuffer | None) -> None:
        if buffer is not None:
            with self._lock:
                self._free.append(buffer)


# What the records in flight may hold at most, in bytes, once two are: a dense record is the size of
# the model, and every read buffer in flight is memory that the first records fault in beside the
# optimizer's steps (at about 1 GB/s on a small VM). Two dense records in flight keep the reads
# going while one is applied; small (sparse) records are bounded by ``window`` instead.
WINDOW_BYTES = 1 << 30


def _load(reader, position: int, buffers: GradientBuffers, times: ReplayTimes, memory: _RecordMemory,
          feed: DeviceFeed | None = None):
    """Read, verify and decode one record into per-buffer updates (a worker thread). Returns them
    with the read buffer they are views of (None: the reader's own bytes, e.g. joined shares).
    With a ``feed`` (a GPU replay) the updates are on their way to the device."""
    started = time.perf_counter()
    data, buffer = reader.read_for_replay(position, memory)
    read = time.perf_counter()
    # Every reader hands over what read_for_replay returns: the values may be decoded as views of it.
    prepared = buffers.prepare(reader.decode_record(position, data, owned=True))
    if feed is not None:
        prepared = feed.stage(prepared)
    times.add(read - started, time.perf_counter() - read)
    return prepared, buffer


class ReplayPipeline:
    """A replay in two halves: built, it starts reading and decoding the first records of ``chain``
    (``window`` of them, on ``workers`` threads); ``run(optimizer)`` then applies them all in step
    order. Built before the full checkpoint is loaded, the decoding of the first records overlaps
    that load (recovery.restore does so for resume), which the optimizer's steps cannot: they
    need the loaded state. ``close()`` (always, e.g. when the load fails) cancels what is left.

    The records are only read and decoded before ``run``: nothing touches the parameters or the
    optimizer until then, so building one early changes no byte of the result."""

    def __init__(self, chain: list, base_step: int, params: list, *, warn, stop_step=None, workers=None,
                 window: int | None = None, times: ReplayTimes | None = None):
        self.buffers = GradientBuffers(params)
        self.feed = DeviceFeed.for_layout(self.buffers.layout)   # None on the CPU
        if workers is None:
            workers = default_workers() if self.feed is None else min(default_workers(), GPU_REPLAY_WORKERS)
        workers = check_workers(workers)
        self.warn, self.base_step = warn, base_step
        self.window = window or (4 * workers if self.feed is None else GPU_REPLAY_WINDOW)
        self.times = times if times is not None else ReplayTimes()
        self.times.workers = workers
        self.tasks = _tasks(chain, base_step + 1, stop_step, warn)
        last_listed = max([entry.last for entry, _ in chain], default=base_step)
        self.expected = min(last_listed, stop_step if stop_step is not None else last_listed) - base_step
        self.in_flight: collections.deque = collections.deque()
        self.memory = _RecordMemory()
        self.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="lowdiff-replay")
        self._fill()

    def _fill(self) -> None:
        _fill(self.in_flight, self.tasks, self.pool, self.window, self.buffers, self.times, self.memory, self.feed)

    def run(self, optimizer):
        """Apply every record through ``optimizer``; (last step, its record). Closes the pipeline."""
        wall_started = time.perf_counter()
        step, last = self.base_step, None
        times, buffers, memory = self.times, self.buffers, self.memory
        progress = Progress(self.expected, "replaying differentials")
        held = None   # the read buffer of the last record applied (its record is returned)
        # keep_freed_memory: each optimizer step reuses the pages of the temporaries the last one freed
        # instead of faulting new ones in (recovery.pipeline.heapreuse: a GPT-2 resume's AdamW steps ran 1.2x
        # (TopK) to 2x (Dense) faster).
        with keep_freed_memory():
            try:
                while self.in_flight:
                    item = self.in_flight.popleft()
                    if isinstance(item, CorruptCheckpointError):
                        self.warn(f"lowdiff: {item}; resuming at step {step}, the last step that verifies")
                        break
                    try:
                        prepared, buffer = item.result()
                    except (CorruptCheckpointError, OSError, EOFError) as exc:
                        self.warn(f"lowdiff: {exc}; resuming at step {step}, the last step that verifies")
                        break
                    started = time.perf_counter()
                    buffers.apply(prepared, optimizer)
                    times.apply_s += time.perf_counter() - started
                    memory.give(held)
                    held = buffer
                    self._fill()   # after the apply: at most ``window`` held
                    times.records += 1
                    progress.update()
                    step, last = prepared.record.step, prepared.record
            finally:
                progress.close()
                self.close()
                buffers.detach()
                times.wall_s += time.perf_counter() - wall_started
        return step, last

    def close(self) -> None:
        """Cancel the decodes not started and wait for those running (idempotent)."""
        for item in self.in_flight:
            if isinstance(item, concurrent.futures.Future):
                item.cancel()
        self.in_flight.clear()
        self.pool.shutdown(wait=True)


def replay(chain: list, base_step: int, params: list, optimizer, *, warn, stop_step=None, workers=None,
           window: int | None = None, times: ReplayTimes | None = None):
    """Apply the records after ``base_step`` found in ``chain`` ([(entry, open BatchReader)]) with
    ``workers`` decoding threads (default: ``default_workers()``, at most GPU_REPLAY_WORKERS onto a
    GPU) and at most ``window`` records in flight (default: 4 per worker, GPU_REPLAY_WINDOW onto a
    GPU; fewer when two or more hold WINDOW_BYTES). Returns (last step, its record); adds timings to ``times``."""
    return ReplayPipeline(chain, base_step, params, warn=warn, stop_step=stop_step, workers=workers, window=window,
                          times=times).run(optimizer)


def _fill(in_flight: collections.deque, tasks, pool, window: int, buffers: GradientBuffers,
          times: ReplayTimes, memory: _RecordMemory, feed: DeviceFeed | None = None) -> None:
    """Submit tasks until ``window`` are in flight, or past two, WINDOW_BYTES (an error item ends
    the task list)."""
    while len(in_flight) < window and not (in_flight and isinstance(in_flight[-1], CorruptCheckpointError)):
        if len(in_flight) >= 2 and sum(getattr(item, "nbytes", 0) for item in in_flight) >= WINDOW_BYTES:
            return
        task = next(tasks, None)
        if task is None:
            return
        if isinstance(task, CorruptCheckpointError):
            in_flight.append(task)
            continue
        future = pool.submit(_load, *task, buffers, times, memory, feed)
        reader, position = task
        future.nbytes = reader.entries[position][2]   # 0: unknown (shares joined in memory)
        in_flight.append(future)
