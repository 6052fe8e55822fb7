"""lowdiff.persist.replica: replica mode (LowDiff+). A background worker keeps a copy of the model and the
optimizer on the CPU, applies every captured step to it (the same optimizer class, hyper-parameters
and gradient, through lowdiff.step.apply, as recovery does), and persists it now and then as an ordinary
full checkpoint, carrying the boundary objects (RNG, buffers, scheduler, extra_state) of the step
it holds. Training never copies its own state for a checkpoint.

Every step's record also goes to the session's differential writer, as in differential mode: the
worker hands it over once it has applied the step, in step order with its persist decisions, so
that no batch spans a step whose replica checkpoint is being taken (the chain from that checkpoint
starts right after it). A record that a committed replica checkpoint already holds is dropped
before its batch is written (lowdiff.persist.background.DiffWriter, ``drop_covered``), so differentials
reach the disk only for the steps since the newest persisted replica. Resume = the newest replica
checkpoint plus the batches after it, through recovery.resume as in any directory.

Flow of one step (training thread, from LowDiffOptimizer): ``gradients()`` before the optimizer
step (the staged gradients, see lowdiff.capture.gradhooks), ``submit(record)`` at the iteration boundary
(the record is handed with its gradient set to the worker, waiting while ``inflight_steps`` steps
are not applied yet; then the next set is made current). ``check()`` first in every step,
``flush()``/``close()`` at the end. Durability: a crash loses the steps the worker has not handed
to the differential writer (at most ``inflight_steps``) and those the writer has not made durable;
``flush()`` lets the worker catch up, then the session flushes the writer. ``close()`` persists the
newest step as a replica checkpoint, so a closed run resumes without replay.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import queue
import threading
import time

import torch

from lowdiff.capture.gradhooks import GradientSet, GradientStaging
from lowdiff.capture.stepcapture import StepCapture
from lowdiff.control.controller import Controller
from lowdiff.persist.background import FullWriter
from lowdiff.persist.threads import ErrorSlot
from lowdiff.step.apply import apply_record


@dataclasses.dataclass
class _Step:
    record: object                 # the StepRecord (its grads are views of gset)
    gset: GradientSet | None       # None: skipped step, or the state was adopted (resync)
    adopted: bool = False          # the replica already holds this step's state: persist only


@dataclasses.dataclass
class _Flush:
    done: threading.Event
    persist: bool                  # persist the newest applied step (close) or only drain (flush, resync)


def build_replica(model: torch.nn.Module, optimizer: torch.optim.Optimizer, params: list):
    """(model, optimizer, params) of a replica: a CPU deep copy of ``model`` and an optimizer of the same
    class over its parameters, with a deep copy of ``optimizer``'s state and param groups (a
    state_dict round trip; not a deep copy of the optimizer, which could keep methods an LR
    scheduler bound to the original). ``params`` are the original's in param_groups order."""
    # The replica lives on the CPU whatever device training uses (host memory is what it saves).
    replica_model = copy.deepcopy(model).to("cpu")
    names = {id(p): n for n, p in model.named_parameters()}
    replica_named = dict(replica_model.named_parameters())
    replica_params = [replica_named[names[id(p)]] for p in params]
    slot = iter(replica_params)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [next(slot) for _ in g["params"]]}
              for g in optimizer.param_groups]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    replica_optimizer = type(optimizer)(groups, **defaults)
    replica_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    return replica_model, replica_optimizer, replica_params


class Replica:
    """The replica of one wrapped optimizer and its worker (see the module docstring)."""

    def __init__(self, capture: StepCapture, store, config, inflight_steps: int, diffs, engine=None,
                 partition=None, layerwise: bool = True):
        """``diffs``: the session's DiffWriter (with ``drop_covered``), which records every step.
        ``partition`` (lowdiff.distributed.partition, under torch.distributed): every rank keeps a whole replica
        (the all-reduced gradients are the same on every rank, and so are the replicas) and writes
        its share of each replica checkpoint, at the same steps as every other rank so that the
        shares form complete sets. ``layerwise=False``: no post-accumulate-grad hooks (DDP)."""
        self.training = capture
        self.diffs = diffs
        self.full_every = int(config.full_every)
        self.inflight_steps = inflight_steps
        self.staging = GradientStaging(capture.params, sets=inflight_steps, hooks=layerwise)
        # A skipped persist would leave the other ranks' shares of that step an incomplete set.
        self._skip_when_busy = partition is None
        self._queue: queue.Queue = queue.Queue()
        # Backpressure: at most ``inflight_steps`` steps handed to the worker and not applied yet
        # (steps skipped by GradScaler, without gradients, count too).
        self._room = threading.Condition()
        self.unapplied = 0
        self.waiting = False      # the training thread waits for the worker now
        # Its own writer and controller: a replica checkpoint costs training no stall, and its
        # timings must not steer the controller's choices for the training thread's checkpoints.
        self.fulls = FullWriter(store, Controller(config), engine, background_copy=False,
                                snapshot=None if partition is None else partition.snapshot())
        self._errors = ErrorSlot(store.durable_step)
        self._thread: threading.Thread | None = None
        self._taken: GradientSet | None = None
        self._resync_due = False
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self._capture: StepCapture | None = None
        self.submitted_step = self.applied_step = self.persist_step = -1
        self._last_record = None
        self.counts = {"persists": 0, "persists_skipped_busy": 0, "resyncs": 0}
        self.max_inflight_seen = 0
        self.max_lag_steps = 0
        self.waits = 0
        self.wait_s = 0.0

    # ------------------------------------------------------------ training thread
    def start(self, step: int) -> None:
        """At the session's first step, with the training state at ``step`` (the base checkpoint's):
        build the replica and start the worker. Once."""
        capture = self.training
        self.model, self.optimizer, self.params = build_replica(capture.model, capture.optimizer, capture.params)
        self._capture = StepCapture(self.optimizer, self.model, capture.compressor)
        self.submitted_step = self.applied_step = self.persist_step = step
        self._thread = threading.Thread(target=self._run, name="lowdiff-replica", daemon=True)
        self._thread.start()

    def gradients(self) -> list:
        """Before the optimizer step: the step's gradients as staged (dense records)."""
        if self._taken is not None:          # a step that failed before submit(): reuse its set
            self.staging.give_back(self._taken)
            self._taken = None
        self._taken, grads = self.staging.take()
        return grads

    def submit(self, record) -> None:
        """At the iteration boundary: hand ``record`` to the worker (which may wait: backpressure),
        then make the next gradient set current."""
        gset, self._taken = self._taken, None
        if self._resync_due:
            self._resync(record, gset)
        else:
            self._hand_over(_Step(record, gset))
        self.submitted_step = record.step
        self.max_lag_steps = max(self.max_lag_steps, self.submitted_step - self.applied_step)
        if self.staging.current is None:
            self.staging.acquire()

    def force_resync(self) -> None:
        """The training state changed outside the steps the replica sees (a change outside step(),
        or a step that failed after the optimizer changed the state): at the next ``submit`` the
        replica adopts the training state and persists it."""
        self._resync_due = True

    def step_failed(self, recorded: bool) -> None:
        if not recorded:
            self.force_resync()

    def _resync(self, record, gset: GradientSet | None) -> None:
        if gset is not None:
            self.staging.give_back(gset)
        self._drain(persist=False)
        assert self.model is not None and self.optimizer is not None
        with torch.no_grad():
            self.model.load_state_dict(self.training.model.state_dict())
        self.optimizer.load_state_dict(copy.deepcopy(self.training.optimizer.state_dict()))
        self._resync_due = False
        self.counts["resyncs"] += 1
        self._hand_over(_Step(record, None, adopted=True))

    def _hand_over(self, step: _Step) -> None:
        """Queue ``step`` for the worker, first waiting while ``inflight_steps`` are unapplied."""
        with self._room:
            if self.unapplied >= self.inflight_steps:
                self.waits += 1
                started = time.perf_counter()
                self.waiting = True
                while self.unapplied >= self.inflight_steps:
                    self._room.wait()
                self.waiting = False
                self.wait_s += time.perf_counter() - started
            self.unapplied += 1
            self.max_inflight_seen = max(self.max_inflight_seen, self.unapplied)
        self._queue.put(step)

    def _drain(self, persist: bool) -> None:
        if self._thread is None:
            return
        done = threading.Event()
        self._queue.put(_Flush(done, persist))
        done.wait()

    def check(self) -> None:
        """Raise the worker's or the replica writer's error, if any (every call, like the writers)."""
        self._errors.check()
        self.fulls.check()

    def flush(self) -> None:
        """Block until every submitted step is applied (the differential writer makes them durable)."""
        self._drain(persist=False)
        self.check()

    def close(self) -> None:
        """Apply every submitted step and persist the newest one, then stop the worker and the
        writer and remove the hooks."""
        try:
            self._drain(persist=True)
            if self._thread is not None:
                self._queue.put(None)
                self._thread.join()
                self._thread = None
        finally:
            self.staging.close()
            self.fulls.close()
        self.check()

    def stats(self) -> dict:
        """How far the replica lags and how often training waited for it."""
        staging = self.staging
        return {"inflight_bound_steps": self.inflight_steps, "applied_step": self.applied_step,
                "lag_steps": max(self.submitted_step - self.applied_step, 0), "max_lag_steps": self.max_lag_steps,
                "persisted_step": self.persist_step,
                "persist_lag_steps": max(self.submitted_step - self.persist_step, 0),
                "max_inflight_steps": self.max_inflight_seen,
                "training_waits": self.waits, "training_wait_s": self.wait_s,
                "gradient_sets": staging.allocated,
                "hook_copies": staging.hook_copies, "step_copies": staging.step_copies,
                "diff_steps_dropped": self.diffs.steps_dropped, **self.counts}

    # ------------------------------------------------------------ worker thread
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if self._errors.error is None:
                    self._handle(item)
            except BaseException as exc:   # kept, and raised by the training thread's next step()
                self._errors.error = exc
            finally:
                if isinstance(item, _Step):
                    if item.gset is not None:
                        self.staging.give_back(item.gset)
                    with self._room:
                        self.unapplied -= 1
                        self._room.notify_all()
                if isinstance(item, _Flush):
                    item.done.set()

    def _handle(self, item) -> None:
        if isinstance(item, _Flush):
            if item.persist and self._last_record is not None and self.persist_step < self.applied_step:
                self.fulls.wait()
                self._persist(self._last_record)
            self.fulls.wait()
            return
        record = item.record
        if item.adopted:
            # The state changed outside the records: a chain of differentials through this step
            # would replay a state this run never had. It ends before this step; the next batch
            # starts after the adopted (persisted) state.
            self.diffs.seal()
        else:
            apply_record(record, self.params, self.optimizer)
            # Recorded from here, in step order with the persist decisions (see _persist).
            if item.gset is not None:
                self.staging.lend(item.gset)
            gset = item.gset
            self.diffs.put(record, release=None if gset is None else lambda: self.staging.give_back(gset))
        self.applied_step, self._last_record = record.step, record
        if item.gset is not None:     # free the gradients before the (longer) snapshot copy
            self.staging.give_back(item.gset)
            item.gset = None
        if item.adopted or record.step - self.persist_step >= self.full_every:
            if self._skip_when_busy and self.fulls.busy() and not item.adopted:
                # The previous replica checkpoint is still being written: persist a later step
                # rather than hold the worker (and so training) back.
                self.counts["persists_skipped_busy"] += 1
            else:
                self._persist(record)

    def _persist(self, record) -> None:
        """Copy the replica (on this thread: the worker changes it next) and write it in the
        background as the full checkpoint of ``record.step``."""
        assert self._capture is not None
        # Every batch written from now on ends at this step, so the chain from this checkpoint
        # finds one starting right after it (records up to it are dropped once it commits).
        self.diffs.end_batch_at(record.step)
        state, meta = self._capture.full_checkpoint(record.objects)
        self.fulls.take(record.step, state, meta, base=False)
        self.persist_step = record.step
        self.counts["persists"] += 1


def check_replica_arguments(compressor, params=(), allow_inexact_gpu: bool = False) -> None:
    """Refuse, before anything is written, what replica mode cannot replicate exactly."""
    from lowdiff.step.compress import Dense

    if not allow_inexact_gpu and any(p.device.type == "cuda" for p in params):
        # The replica applies each step with the CPU optimizer kernels; CUDA's fused/foreach ones
        # round differently (FMA contraction, another reduction order), so its checkpoints would
        # drift from the training state by rounding and a resume from one would not be exact.
        raise ValueError("replica mode (lowdiff.Replica) keeps its replica on the CPU, and the CPU optimizer does "
                         "not round as the CUDA one does: a resume from a persisted replica of this GPU model "
                         "would not equal the uninterrupted run bit for bit. Use lowdiff.Fixed(...) (exact on a "
                         "GPU), or accept that with lowdiff.Replica(..., allow_inexact_gpu=True)")

    if not isinstance(compressor, Dense):
        raise ValueError(f"replica mode (lowdiff.Replica) applies the dense gradient the optimizer consumed; use "
                         f"compressor=lowdiff.Dense(), not {compressor!r}")
