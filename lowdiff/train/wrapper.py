"""lowdiff.wrap: the optimizer facade. It steps the wrapped optimizer and, on every step, has
lowdiff.capture.stepcapture record what the step did and lowdiff.persist.session persist it, with a full
checkpoint now and then.

Durability contract: ``step()`` returns before its record is on disk. ``flush()`` blocks until every
recorded step is durable. A process killed with SIGKILL loses at most the steps not yet flushed,
bounded by ``max_pending_batches`` batches (step() blocks when more are outstanding), and never
loses or corrupts what was already durable.
"""
from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable
from types import TracebackType
from typing import Any, Literal, NoReturn, overload

import torch

import fastio
from fastio._engine import Engine
from lowdiff import faults
from lowdiff.capture import loopchecks
from lowdiff.capture.betweensteps import BetweenStepsWatch
from lowdiff.capture.stepcapture import StepCapture
from lowdiff.control.controller import Controller
from lowdiff.distributed.ddp import distributed_rank, is_ddp
from lowdiff.distributed.drives import spread_over_drives
from lowdiff.distributed.sharding import refuse_unsupported_sharding
from lowdiff.errors import CheckpointError
from lowdiff.persist.replica import Replica as ReplicaWorker
from lowdiff.persist.replica import check_replica_arguments
from lowdiff.persist.session import CheckpointSession
from lowdiff.step.compress import Dense, TopK
from lowdiff.store.directory import CheckpointStore
from lowdiff.store.retention import Policy
from lowdiff.tiers.policy import Tiers, tiers_partition
from lowdiff.train.config import Scheduler, Stateful, WrapConfig, check_wrap_arguments
from lowdiff.train.lifecycle import Busy, install_exit_hooks, live
from lowdiff.train.options import Options, Schedule, translate_deprecated, wrap_config


def _kept_by(part: str, name: str, doc: str) -> Any:
    """An attribute of the facade that one of its parts (``_capture`` or ``_session``) keeps.
    (A property, typed Any so that each attribute's annotation in the class states its type.)"""
    return property(lambda self: getattr(getattr(self, part), name),
                    lambda self, value: setattr(getattr(self, part), name, value), doc=doc)


class LowDiffOptimizer(torch.optim.Optimizer):
    """Drop-in optimizer: ``step`` = compress -> inner step -> scheduler step -> record.

    It subclasses ``torch.optim.Optimizer`` only so that LR schedulers and GradScaler accept it;
    all optimizer state lives in the wrapped optimizer (``.optimizer``). What a step records is
    built by its ``StepCapture``; the files and background writers are its ``CheckpointSession``.
    """

    # GradScaler then calls step() on every iteration (also when it found inf/NaN) with
    # ``grad_scale``/``found_inf`` set, so a skipped step is still an iteration we record.
    _step_supports_amp_scaling = True

    optimizer: torch.optim.Optimizer = _kept_by("_capture", "optimizer",
                                                "The wrapped optimizer (it holds all optimizer state).")
    model: torch.nn.Module = _kept_by("_capture", "model", "The model (unwrapped from DDP).")
    compressor: Dense | TopK = _kept_by("_capture", "compressor", "How gradients are compressed (Dense() by default).")
    scheduler: Scheduler | None = _kept_by("_capture", "scheduler",
                                           "The LR scheduler stepped after each step, or None.")
    extra_state: dict[str, Stateful] = _kept_by("_capture", "extra_state",
                                                "Named objects with state_dict(), saved at each step.")
    grad_scaler: torch.amp.GradScaler | None = _kept_by("_capture", "grad_scaler",
                                                        "The GradScaler whose state is saved, or None.")
    residuals: dict[int, torch.Tensor] = _kept_by("_capture", "residuals",
                                                  "Error-feedback residuals of the compressor, by slot.")
    param_names: list[str] = _kept_by("_capture", "param_names", "Names of the optimizer's parameters, in order.")
    outside_changes: int = _kept_by("_capture", "outside_changes",
                                    "How many steps found a parameter changed outside step().")
    controller: Controller = _kept_by("_session", "controller",
                                      "Picks full_every and batch_steps (see lowdiff.control.controller).")
    store: CheckpointStore = _kept_by("_session", "store", "The checkpoint directory's store.")
    directory: str = _kept_by("_session", "directory", "Where this process's checkpoints are.")
    _fulls = _kept_by("_session", "fulls", "The full-checkpoint writer (kept for tests that inspect it).")

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, directory: str | os.PathLike[str],
                 config: WrapConfig, *, compressor: Dense | TopK | None = None, scheduler: Scheduler | None = None,
                 extra_state: dict[str, Stateful] | None = None, grad_scaler: torch.amp.GradScaler | None = None,
                 engine: Engine | None = None) -> None:
        """Use ``lowdiff.wrap``. ``config``: its settings (lowdiff.train.options.wrap_config);
        ``engine``: the fastio engine to write with (None: the process-wide one) — the internal way
        for tests and benchmarks to choose one; wrap() has no such keyword."""
        if isinstance(optimizer, LowDiffOptimizer):
            raise TypeError("optimizer is already wrapped by lowdiff")
        check_wrap_arguments(optimizer, model, directory, compressor, scheduler, extra_state)
        loopchecks.refuse_unreplayable(optimizer, model, scheduler)
        refuse_unsupported_sharding(optimizer, model, replica=config.replica)
        loopchecks.warn_unsaved_scheduler(optimizer, scheduler, extra_state)
        loopchecks.warn_inexact_loaders(extra_state or {})
        if engine is None:
            # The I/O backend is chosen (and a bad FASTIO_BACKEND refused) here, not at the first step.
            fastio.engine()
        self.config = config
        self._capture = StepCapture(optimizer, model, compressor if compressor is not None else Dense(),
                                    scheduler=scheduler, extra_state=extra_state, grad_scaler=grad_scaler)
        self.rank, self.world_size = distributed_rank()
        if config.differentials is not True and self.world_size > 1:
            # Ranks would have to agree on every switch (and on every auto full_every) to keep sets complete.
            raise ValueError(f"differentials={config.differentials!r} is not supported under torch.distributed yet")
        auto = [name for name in ("full_every", "batch_steps") if getattr(config, name) == "auto"]
        if auto and self.world_size > 1:
            # Each rank's controller measures its own costs and would choose its own settings; the
            # shares of a checkpoint or batch form a set only when every rank cuts at the same steps.
            raise ValueError(f"{' and '.join(auto)}='auto' is not supported under torch.distributed yet: every rank "
                             f"must checkpoint at the same steps; give integers (python -m lowdiff tune suggests them)")
        if config.replica:
            check_replica_arguments(self._capture.compressor, self._capture.params, config.replica_inexact_gpu)
        # Under torch.distributed each rank writes its share of every checkpoint, with its own
        # RNG, sampler and residuals, into its rank directory (lowdiff.distributed.partition).
        partition = tiers_partition(directory, self.config.tiers, self.rank, self.world_size, self._capture.params)
        if partition is not None and config.stripe_dirs:
            # The ranks of a node spread over its drives: each rank directory on one (a collective).
            spread_over_drives(partition, config.stripe_dirs)
        self._session = CheckpointSession(directory, self.config, engine, partition=partition)
        if partition is not None:
            self._capture.record_only(partition.slots)
        # Replica mode (LowDiff+): a background replica persisted as full checkpoints; differentials
        # only for the steps since the newest persisted replica.
        self._replica = ReplicaWorker(self._capture, self._session.store, config, config.replica_inflight_steps,
                                      self._session.diffs, engine, partition=partition,
                                      layerwise=not is_ddp(model)) if config.replica else None
        self.step_count = 0
        self._capture.capture_base_boundary()
        self._schedulers = loopchecks.SchedulerWatch(scheduler, extra_state or {})
        self._between = BetweenStepsWatch(self._capture.model)
        self._between.boundary_passed(0, None)
        self._pending: tuple | None = None      # a step whose boundary is not recorded yet (manual)
        self._scaler_warned = False
        self._busy = 0                          # see lifecycle.Busy
        live.add(self)
        install_exit_hooks()

    # ------------------------------------------------------------ optimizer surface
    # torch.optim.Optimizer declares these as plain attributes; the facade forwards them to the
    # wrapped optimizer read-only (they must not diverge from it), hence the override ignores.
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> defaultdict[torch.Tensor, Any]:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Busy: a SIGTERM flushing from inside release() would wait for a copy nobody judges.
        with Busy(self):
            self._session.fulls.release()
            self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> NoReturn:
        raise CheckpointError("lowdiff records gradients by parameter position; add param groups before wrap()")

    def __repr__(self) -> str:
        return f"LowDiffOptimizer({self.optimizer!r}, directory={self.directory!r})"

    def __getstate__(self) -> NoReturn:
        raise TypeError("a LowDiffOptimizer owns files and threads and cannot be pickled")

    # ------------------------------------------------------------ the step
    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """compress -> inner step -> scheduler step -> record (see the module docstring)."""
        if self.grad_scaler is None and not self._scaler_warned:
            scaler = loopchecks.calling_grad_scaler()
            if scaler is not None:
                self._scaler_warned = True
                loopchecks.warn_unknown_scaler(scaler)
        with Busy(self):
            return self._step(closure)

    def _step(self, closure):
        session, capture = self._session, self._capture
        if session.closed:
            raise CheckpointError("step() on a closed lowdiff optimizer")
        # A failed background write ends checkpointing: refuse before anything changes, every time.
        session.check_writers()
        session.wait_for_shared()
        replica = self._replica
        if replica is not None:
            replica.check()
        if not session.base_taken:
            session.check_can_start(self.step_count)
            session.take_full(self.step_count, *capture.base_checkpoint(), base=True)
            if replica is not None:
                replica.start(self.step_count)
        else:
            capture.check_untouched(self.step_count, session.force_full if replica is None else replica.force_resync)
        if self._pending is not None:
            raise CheckpointError('wrap(options=lowdiff.Options(boundary="manual")): call opt.boundary() after each '
                                  'opt.step() (once the loop\'s work after the step is done) before the next '
                                  'opt.step()')
        self._schedulers.step_starting()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skipped = capture.unscale_for_amp(getattr(self, "found_inf", None), getattr(self, "grad_scale", None))
        # A full checkpoint copied in the background must be complete before state changes.
        # (Called from here so that its warning points at the caller of step().)
        session.fulls.release()
        capture_started = time.perf_counter()
        groups_used = capture.hyperparameters()
        recording = session.begin_step() if replica is None else True
        # Without differentials a Dense gradient need not be copied; TopK still sparsifies the
        # gradient the optimizer consumes (that is the training's math), unrecorded.
        if skipped or not (recording or capture.compressor.name != "dense"):
            grads = None
        else:
            grads = capture.compress_gradients() if replica is None else replica.gradients()
            if not recording:
                grads = None
        started = time.perf_counter()
        if not skipped:
            self.optimizer.step()
        self.step_count += 1
        try:
            optimizer_s = time.perf_counter() - started
            session.controller.step_finished(optimizer_s, recording)
            if self.scheduler is not None:
                if skipped:   # torch's warning about it would point here: said at the user's line
                    loopchecks.step_scheduler_of_skipped(self.scheduler, self.step_count)
                else:
                    self.scheduler.step()
        except BaseException:
            session.step_failed(False)
            if replica is not None:
                replica.step_failed(False)
            capture.mark_state()
            self._schedulers.step_finished()    # a scheduler that raised in step() moved: not the loop's doing
            raise
        self._pending = (skipped, grads, groups_used, capture_started, optimizer_s)
        try:
            if self.config.boundary == "step":
                self._record_boundary()
        finally:
            # Our own failure is not the user's change outside step().
            capture.mark_state()
        return loss

    def boundary(self) -> None:
        """With ``wrap(options=lowdiff.Options(boundary="manual"))``: the iteration ends here. The
        step just taken is recorded with the RNG, buffers, scheduler and ``extra_state`` as they are
        now, after the work the loop did since ``opt.step()`` (validation, a ReduceLROnPlateau or EMA
        update, a scheduler stepped by the loop). Call it once after every ``opt.step()``."""
        if self.config.boundary != "manual":
            raise CheckpointError('boundary() is for wrap(options=lowdiff.Options(boundary="manual")); by default '
                                  'the iteration boundary is the end of opt.step()')
        if self._pending is None:
            raise CheckpointError("boundary() without an opt.step() since the last boundary()")
        with Busy(self):
            self._record_boundary()

    def _record_boundary(self) -> None:
        """Record the pending step with the boundary objects as they are now; take a full
        checkpoint if one is due."""
        session, capture = self._session, self._capture
        assert self._pending is not None
        skipped, grads, groups_used, capture_started, optimizer_s = self._pending
        self._pending = None
        recorded = False
        try:
            record = capture.record(self.step_count, skipped, grads, groups_used)
            if self._replica is not None:
                self._replica.submit(record)   # a differential, and applied to the replica in the background
            elif session.recording:
                session.diffs.put(record)
            else:
                session.hold_unrecorded(self.step_count, record.objects)
            recorded = True
            self._schedulers.step_finished()
            self._between.boundary_passed(self.step_count, record.objects)
            if session.recording or self._replica is not None:
                # What recording cost this step: all but the optimizer step (the controller's record_s).
                session.controller.step_recorded(time.perf_counter() - capture_started - optimizer_s)
            faults.point("record")
            if self._replica is not None:
                pass   # the replica worker takes the full checkpoints
            elif session.full_checkpoint_due(self.step_count):
                session.take_full(self.step_count, *capture.full_checkpoint(record.objects), base=False)
            else:
                # Optimizer state exists now (Adam creates it lazily): size staging for it off-thread.
                session.prepare_staging(capture.state_nbytes)
        except BaseException:
            # The state moved past what the records hold: end the batch before the gap, and take
            # a full checkpoint at the end of the next step so that resuming is exact from there.
            session.step_failed(recorded)
            if self._replica is not None:
                self._replica.step_failed(recorded)
            self._schedulers.step_finished()    # what was stepped before the failure is not stepped again
            raise

    def skip_between_steps_check(self) -> None:
        """Do not judge what happens from now to the next training forward in the between-steps
        check (lowdiff.capture.betweensteps): for frameworks whose resume restores it exactly — Hugging
        Face Trainer starts an epoch's iterator, drawing from the global RNG, and at resume
        restores the RNG after that (lowdiff.integrations.hf calls this at each epoch start)."""
        self._between.boundary_passed(self.step_count, None)

    # ------------------------------------------------------------ resume support
    def continue_after(self, step: int, residuals: dict[int, torch.Tensor] | None = None) -> None:
        """Continue recording after step ``step``: the next ``step()`` records step ``step + 1``,
        starting with a base checkpoint of the state as it is now (the restored one), and may
        overwrite what the directory holds after ``step``. ``residuals`` are the compressor's
        error-feedback residuals to continue with, by slot (None: zero).

        ``recovery.resume`` calls this after restoring the training state. It must be called
        before the first ``step()`` (CheckpointError otherwise)."""
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        self._session.mark_resumed()
        self.step_count = step
        self._capture.restart(residuals)
        if step > 0:    # a restored state: its first window is compared with the next (betweensteps)
            self._between.resumed(step, self._capture.restored_boundary)
        else:
            self._between.boundary_passed(step, None)

    # ------------------------------------------------------------ durability
    def stats(self) -> dict[str, Any]:
        """What checkpointing has cost this process so far, as lowdiff measured it: the training
        thread's stall per full checkpoint (staging, plus waiting for a background copy at the
        next step), the background persist time of a full checkpoint and the write time of a
        differential batch (median/max over the last 1000, in ms), with the settings in force, and
        how many steps found a parameter changed outside step() (each forced a full checkpoint).
        Under "controller": the measured costs, the cost model's prediction for the settings in
        force and the controller's decisions (JSON-serialisable; ``python -m lowdiff tune`` reads it)."""
        # Busy: a SIGTERM flushing while this holds the controller's lock would deadlock.
        with Busy(self):
            stats = self._session.stats(self.step_count, self.outside_changes)
            if self._replica is not None:
                stats["replica"] = self._replica.stats()
            return stats

    @property
    def durable_step(self) -> int:
        """The newest step that is on disk and can be resumed (-1 before the first commit). With
        storage tiers, on the local tier: see ``shared_durable_step``."""
        return self._session.durable_step()

    @property
    def shared_durable_step(self) -> int | None:
        """With storage tiers, the newest step the shared tier alone can be resumed at: what
        survives losing the local directory. It trails ``durable_step`` by what the drainer has not
        copied yet, at most about ``Tiers(max_lag_steps=...)`` steps plus two batches (``step()``
        waits beyond that). None without tiers; -1 before the shared tier's first commit."""
        return self._session.shared_durable_step()

    def flush(self) -> None:
        """Block until every recorded step (and any full checkpoint in progress) is durable.
        Raises the error of a failed background write (every time: checkpointing has stopped)."""
        if self._session.closed:
            self._session.check_writers()
            return
        with Busy(self):
            if self._pending is not None:     # manual boundary: the iteration ends here
                self._record_boundary()
            if self._replica is not None:
                self._replica.flush()
            self._session.save_unrecorded(self._capture.full_checkpoint)   # differentials off
            self._session.flush()

    def close(self) -> None:
        """Flush, stop the background threads, release the directory lock. Idempotent, except
        that a failed background write is raised by every call (the steps after
        ``durable_step`` are not on disk)."""
        if self._session.closed:
            self._session.check_writers()
            return
        try:
            with Busy(self):
                if self._pending is not None:     # manual boundary: the iteration ends here
                    self._record_boundary()
                try:
                    if self._replica is not None:
                        self._replica.close()
                    self._session.save_unrecorded(self._capture.full_checkpoint)   # differentials off
                finally:
                    self._session.close_writers()
        finally:
            self._between.remove()
            self._session.close_store()
            live.discard(self)

    def __enter__(self) -> LowDiffOptimizer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        self.close()
        return False


def wrap(optimizer: torch.optim.Optimizer, model: torch.nn.Module, directory: str | os.PathLike[str], *,
         compressor: Dense | TopK | None = None, full_every: int | Literal["auto"] | None = None,
         batch_steps: int | Literal["auto"] | None = None, scheduler: Scheduler | None = None,
         extra_state: dict[str, Stateful] | None = None, grad_scaler: torch.amp.GradScaler | None = None,
         schedule: Schedule | None = None, retention: Policy | None = None, tiers: Tiers | None = None,
         options: Options | None = None, **deprecated: Any) -> LowDiffOptimizer:
    """Wrap ``optimizer`` so every step is recorded under ``directory``. See LowDiffOptimizer.

    ``compressor``: ``lowdiff.Dense()`` (default) or ``lowdiff.TopK(ratio)``. When to checkpoint:
    ``full_every``/``batch_steps`` (ints, or "auto": the controller chooses, docs/controller.md;
    defaults 100 and 10), or ``schedule=lowdiff.Fixed(...)``, ``lowdiff.Auto(...)`` (failure rate,
    recovery budget, batch memory, ``differentials`` True/False/"auto") or ``lowdiff.Replica(...)``
    (LowDiff+ replica mode) — lowdiff.train.options. ``retention``: what the directory keeps
    (``lowdiff.KeepLast(2)`` by default, ``KeepEvery``, ``KeepAll``). ``tiers=lowdiff.Tiers(shared_dir,
    ...)``: ``directory`` is the fast local tier, and every committed file is copied to the shared
    one in the background (lowdiff.tiers.drainer; ``close()`` waits until it is all there).
    ``options=lowdiff.Options(boundary="manual", max_pending_batches=..., overwrite=...)``: the loop
    and durability knobs. The keywords wrap had before these objects (``keep_full``, ``replica``,
    ``differentials``, ...) still work, with a DeprecationWarning naming the new spelling."""
    given: dict[str, Any] = {"full_every": full_every, "batch_steps": batch_steps, "schedule": schedule,
                             "retention": retention, "tiers": tiers, "options": options}
    engine = translate_deprecated(deprecated, given, stacklevel=2) if deprecated else None
    return LowDiffOptimizer(optimizer, model, directory, wrap_config(**given), compressor=compressor,
                            scheduler=scheduler, extra_state=extra_state, grad_scaler=grad_scaler, engine=engine)
