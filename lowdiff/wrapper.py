"""lowdiff.wrap: an optimizer that records every step as a differential and takes full
checkpoints now and then.

Durability contract: ``step()`` returns before its record is on disk. ``flush()`` blocks until every
recorded step is durable. A process killed with SIGKILL loses at most the steps not yet flushed,
bounded by ``max_pending_batches`` batches (step() blocks when more are outstanding), and never
loses or corrupts what was already durable.
"""
from __future__ import annotations

import logging
import os
import time
import warnings

import torch

import fastio

from . import capture, faults
from .background import DiffWriter, FullWriter
from .compress import Compressed, Dense, decompress_into
from .config import WrapConfig, check_wrap_arguments
from .controller import Controller
from .ddp import AggregatedRecorder, CompressedAllReduce, distributed_rank, is_ddp
from .errors import CheckpointError
from .lifecycle import Busy, install_exit_hooks, live
from .records import StepRecord
from .store import CheckpointStore

log = logging.getLogger("lowdiff")


class LowDiffOptimizer(torch.optim.Optimizer):
    """Drop-in optimizer: ``step`` = compress -> inner step -> scheduler step -> record.

    It subclasses ``torch.optim.Optimizer`` only so that LR schedulers and GradScaler accept it;
    all optimizer state lives in the wrapped optimizer (``.optimizer``).
    """

    # GradScaler then calls step() on every iteration (also when it found inf/NaN) with
    # ``grad_scale``/``found_inf`` set, so a skipped step is still an iteration we record.
    _step_supports_amp_scaling = True

    def __init__(self, optimizer, model, directory, *, compressor=None, full_every=100, batch_steps=10,
                 scheduler=None, extra_state=None, keep_full=2, grad_scaler=None, max_pending_batches=2,
                 overwrite=False, failure_rate_per_hour=0.1, engine=None):
        if isinstance(optimizer, LowDiffOptimizer):
            raise TypeError("optimizer is already wrapped by lowdiff")
        check_wrap_arguments(optimizer, model, directory, compressor, scheduler, extra_state)
        if engine is None:
            # The I/O backend is chosen (and a bad FASTIO_BACKEND refused) here, not at the first step.
            fastio.engine()
        self.config = WrapConfig(full_every=full_every, batch_steps=batch_steps, keep_full=keep_full,
                                 max_pending_batches=max_pending_batches, overwrite=overwrite,
                                 failure_rate_per_hour=failure_rate_per_hour)
        self.optimizer = optimizer
        self.model = model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model
        self.compressor = compressor if compressor is not None else Dense()
        self.scheduler = scheduler
        self.extra_state = dict(extra_state or {})
        self.grad_scaler = grad_scaler
        self.residuals: dict = {}
        self.controller = Controller(self.config)
        names = {id(p): n for n, p in self.model.named_parameters()}
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        self.param_names = [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(self._params)]
        slot_of = {id(p): i for i, p in enumerate(self._params)}
        live_state = self.model.state_dict(keep_vars=True)
        # Keys of the model's state that are optimizer parameters (tied weights appear under several).
        self._param_aliases = {k: slot_of[id(v)] for k, v in live_state.items() if id(v) in slot_of}
        self._buffer_names = capture.persistent_buffer_names(self.model)
        self.rank, self.world_size = distributed_rank()
        if self.world_size > 1:
            # Each rank records its own stream (its RNG, sampler and residuals differ); resume
            # makes all ranks agree on one step.
            directory = rank_directory(directory, self.rank)
        self._recorder = self.compressor
        if is_ddp(model):
            hook = CompressedAllReduce(self.compressor, self.residuals)
            model.register_comm_hook(hook, CompressedAllReduce.hook)
            self._recorder = AggregatedRecorder(sparse=self.compressor.name == "topk")
        self.store = CheckpointStore(directory, keep_full)
        self.directory = self.store.directory
        self._engine = engine
        self._diffs = DiffWriter(self.store, self.controller, self.config.max_pending_batches, engine)
        self._fulls = FullWriter(self.store, self.controller, engine)
        self.step_count = 0
        self._resumed = False
        self._base_taken = False
        self._closed = False
        self._last_full_step = 0
        self._boundary = self._capture_boundary()
        self._staging_prepared = False
        self._full_due = False                  # take a full checkpoint at the end of this step
        self._state_marks = None                # see _training_state_marks, at the last iteration boundary
        self.outside_changes = 0                # steps that found a parameter changed outside step()
        self._busy = 0
        live.add(self)
        install_exit_hooks()

    # ------------------------------------------------------------ optimizer surface
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        self._fulls.release()
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group):
        raise CheckpointError("lowdiff records gradients by parameter position; add param groups before wrap()")

    def __repr__(self):
        return f"LowDiffOptimizer({self.optimizer!r}, directory={self.directory!r})"

    def __getstate__(self):
        raise TypeError("a LowDiffOptimizer owns files and threads and cannot be pickled")

    # ------------------------------------------------------------ the step
    def step(self, closure=None):
        """compress -> inner step -> scheduler step -> record (see the module docstring)."""
        with Busy(self):
            return self._step(closure)

    def _step(self, closure):
        if self._closed:
            raise CheckpointError("step() on a closed lowdiff optimizer")
        # A failed background write ends checkpointing: refuse before anything changes, every time.
        self._check_writers()
        if not self._base_taken:
            self._take_base()
        else:
            self._check_state_untouched()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        skipped = self._unscale_for_amp()
        # A full checkpoint copied in the background must be complete before state changes.
        self._fulls.release()
        groups_used = capture.hyperparameters(self.optimizer.param_groups)
        grads = None if skipped else self._compress_gradients()
        started = time.perf_counter()
        if not skipped:
            self.optimizer.step()
        self.step_count += 1
        recorded = False
        try:
            self.controller.step_finished(time.perf_counter() - started)
            if self.scheduler is not None:
                self.scheduler.step()
            record = StepRecord(self.step_count, skipped, grads or [], self._boundary_objects(groups_used, skipped))
            self._diffs.put(record)
            recorded = True
            faults.point("record")
            if self._full_due or self.step_count - self._last_full_step >= self.controller.full_every:
                self._full_due = False
                self._take_full(base=False, boundary=record.objects)
            elif not self._staging_prepared:
                # Optimizer state exists now (Adam creates it lazily): size staging for it off-thread.
                self._staging_prepared = True
                self._fulls.prepare(self._state_nbytes())
        except BaseException:
            # The state moved past what the records hold: end the batch before the gap, and take
            # a full checkpoint at the end of the next step so that resuming is exact from there.
            self._full_due = True
            if not recorded:
                self._diffs.seal()
            raise
        finally:
            # Our own failure is not the user's change outside step().
            self._state_marks = self._training_state_marks()
        return loss

    def _check_writers(self) -> None:
        """Re-raise a background write error (sticky: until this optimizer is closed)."""
        self._diffs.check()
        self._fulls.check()

    def _training_state_marks(self) -> set | None:
        """What changes whenever the parameters or the optimizer's tensors change: each one's
        version counter (bumped by in-place changes) and, for optimizer state, its identity (a
        tensor replaced, e.g. by load_state_dict), as (slot, key, ...) tuples. About 0.5 µs per
        tensor; None if a tensor keeps no version counter (inference tensors)."""
        try:
            marks = {(slot, None, p._version) for slot, p in enumerate(self._params)}
            state = self.optimizer.state
            for slot, p in enumerate(self._params):
                entries = state.get(p)
                if entries:
                    marks.update((slot, key, id(v), v._version) for key, v in entries.items()
                                 if isinstance(v, torch.Tensor))
        except RuntimeError:
            return None
        return marks

    def _check_state_untouched(self) -> None:
        """A parameter or optimizer tensor changed since the last step() (outside it) is a change
        no differential holds: replay would miss it. Say so, and take a full checkpoint at the end
        of this step, so that resuming from here on is exact again."""
        if self._state_marks is None:
            return
        now = self._training_state_marks()
        if now is None or now == self._state_marks:
            return
        self._full_due = True
        self.outside_changes += 1
        if self.outside_changes == 1:
            changed = sorted({self.param_names[slot] + ("" if key is None else f" (optimizer state {key!r})")
                              for slot, key, *_ in now ^ self._state_marks})
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            warnings.warn(
                f"lowdiff: {shown} changed after step {self.step_count}, outside step(). "
                f"Differentials cannot replay that, so lowdiff takes a full checkpoint at the end of this step "
                f"(and after any further such change; this warning is shown once). Resuming at a step in "
                f"between would not match this run. Make such changes inside the optimizer step to keep "
                f"per-step checkpoints cheap.", RuntimeWarning, stacklevel=4)

    def _state_nbytes(self) -> int:
        """About the payload of a full checkpoint: model and optimizer tensors, page-rounded."""
        tensors = list(self.model.state_dict().values())
        tensors += [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        tensors += list(self.residuals.values())
        return sum(-(-t.numel() * t.element_size() // 4096) * 4096 for t in tensors) + (1 << 20)

    def _unscale_for_amp(self) -> bool:
        """With GradScaler: unscale as GradScaler.unscale_ would, report whether the step is skipped."""
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None:
            return False
        if bool(found_inf.item()):
            return True
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            inv_scale = scale.double().reciprocal().float()
            grads = [p.grad for p in self._params if p.grad is not None]
            by_device: dict = {}
            for g in grads:
                by_device.setdefault((g.device, g.dtype), []).append(g)
            for (device, _), group in by_device.items():
                dummy = torch.zeros(1, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(group, dummy, inv_scale.to(device))
        return False

    def _compress_gradients(self) -> list:
        """Compress every gradient in parameter order and put back the exact tensor recorded."""
        out = []
        for slot, p in enumerate(self._params):
            if p.grad is None:
                out.append(_NO_GRAD)
                continue
            if p.grad.is_sparse:
                raise TypeError(f"parameter {self.param_names[slot]!r} has a sparse gradient; not supported")
            compressed = self._recorder.compress(p.grad, slot, self.residuals)
            # Under DDP the comm hook already produced the gradient: it is recorded unchanged.
            if self._recorder is self.compressor:
                if compressed.kind == "sparse":
                    decompress_into(compressed, p.grad)
                elif self.compressor.error_feedback:
                    p.grad.view(-1).copy_(compressed.values)  # dense with error feedback: grad+residual
            out.append(compressed)
        return out

    def _boundary_objects(self, groups_used: list, skipped: bool) -> dict:
        objects = {"groups_used": groups_used,
                   "groups_after": capture.hyperparameters(self.optimizer.param_groups),
                   **self._capture_boundary()}
        if self.scheduler is not None:
            objects["scheduler"] = capture.state_dict_copy(self.scheduler)
        if self.grad_scaler is not None:
            objects["grad_scaler"] = {"state": self.grad_scaler.state_dict(), "found_inf": skipped}
        return objects

    # ------------------------------------------------------------ full checkpoints
    def _capture_boundary(self) -> dict:
        """What the base checkpoint needs from the iteration boundary before the first step: it is
        taken inside that step's step(), after its forward pass drew random numbers, advanced the
        sampler and updated BatchNorm statistics."""
        return {"rng": capture.capture_rng(), "extra": capture.state_dicts(self.extra_state),
                "buffers": capture.module_buffers(self.model, self._buffer_names)}

    def _take_base(self) -> None:
        latest = self.store.latest_step()
        if not self._resumed and latest > self.step_count and not self.config.overwrite:
            raise CheckpointError(
                f"{self.directory} already holds checkpoints up to step {latest}; call "
                f"recovery.resume(directory, model, optimizer) before training, or wrap(..., overwrite=True)")
        self._take_full(base=True)
        self._base_taken = True

    def _take_full(self, base: bool, boundary: dict | None = None) -> None:
        """Full checkpoint of the state at this iteration boundary. ``boundary`` holds the small
        objects captured there (the step's record has them; the base uses ``self._boundary``),
        including copies of the buffers, which the next forward pass changes in place while
        the parameters and optimizer state are copied in the background."""
        self._last_full_step = self.step_count
        if base:
            boundary, self._boundary = self._boundary, None
            boundary = {**boundary, "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
            if self.grad_scaler is not None:
                # GradScaler.update() runs after step(): store the pre-update state and what update() needs.
                boundary["grad_scaler"] = {"state": self.grad_scaler.state_dict(), "found_inf": None}
        state = {
            "model": {**self.model.state_dict(), **boundary["buffers"]},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": boundary.get("scheduler"),
            "extra": boundary["extra"],
            "rng": boundary["rng"],
            "residuals": dict(self.residuals),
            "grad_scaler": boundary.get("grad_scaler"),
        }
        meta = {"param_names": self.param_names, "param_aliases": self._param_aliases,
                "optimizer_class": f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}",
                "compressor": repr(self.compressor)}
        self._fulls.take(self.step_count, state, meta, base)
        # Close the batch ending at this step, so the chain from the previous full checkpoint
        # reaches it (queued before any later record).
        self._diffs.seal()

    # ------------------------------------------------------------ durability
    def stats(self) -> dict:
        """What checkpointing has cost this process so far, as lowdiff measured it: the training
        thread's stall per full checkpoint (staging, plus waiting for a background copy at the
        next step), the background persist time of a full checkpoint and the write time of a
        differential batch (median/max over the last 1000, in ms), with the settings in force, and
        how many steps found a parameter changed outside step() (each forced a full checkpoint)."""
        return {"step": self.step_count, "full_every": self.controller.full_every,
                "batch_steps": self.controller.batch_steps, "background_copy": self._fulls.background_copy,
                "outside_changes": self.outside_changes,
                **self.controller.stats()}

    @property
    def durable_step(self) -> int:
        """The newest step that is on disk and can be resumed (-1 before the first commit)."""
        return self.store.durable_step()

    def flush(self) -> None:
        """Block until every recorded step (and any full checkpoint in progress) is durable.
        Raises the error of a failed background write (every time: checkpointing has stopped)."""
        if self._closed:
            self._check_writers()
            return
        with Busy(self):
            self._diffs.flush()
            self._fulls.wait()
            self._check_writers()

    def close(self) -> None:
        """Flush, stop the background threads, release the directory lock. Idempotent, except
        that a failed background write is raised by every call (the steps after
        ``durable_step`` are not on disk)."""
        if self._closed:
            self._check_writers()
            return
        try:
            with Busy(self):
                try:
                    self._diffs.close()
                finally:
                    self._fulls.close()
                self._check_writers()
        finally:
            self._closed = True
            self.store.close()
            live.discard(self)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    # ------------------------------------------------------------ resume support
    def _resumed_at(self, step: int, residuals: dict | None) -> None:
        """Called by recovery.resume: continue recording after ``step``."""
        if self._base_taken:
            raise CheckpointError("resume must happen before the first step() of a lowdiff optimizer")
        self.step_count = step
        self._resumed = True
        self.residuals.clear()  # in place: the DDP comm hook holds this dict
        self.residuals.update(residuals or {})
        self._boundary = self._capture_boundary()  # the restored state is the boundary


def rank_directory(directory, rank: int) -> str:
    """Where rank ``rank`` of a multi-process run keeps its stream."""
    return os.path.join(os.fspath(directory), f"rank-{rank:05d}")


_NO_GRAD = Compressed("none", 0, None)


def wrap(optimizer, model, directory, *, compressor=None, full_every=100, batch_steps=10, scheduler=None,
         extra_state=None, keep_full=2, **options) -> LowDiffOptimizer:
    """Wrap ``optimizer`` so every step is recorded under ``directory``. See LowDiffOptimizer."""
    return LowDiffOptimizer(optimizer, model, directory, compressor=compressor, full_every=full_every,
                            batch_steps=batch_steps, scheduler=scheduler, extra_state=extra_state,
                            keep_full=keep_full, **options)
