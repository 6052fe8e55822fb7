"""lowdiff.capture.stepcapture: what one optimizer step records (its gradients, hyper-parameters and the
objects of the iteration boundary), what a full checkpoint holds, and the detection of changes
made to the training state outside ``step()``.

Everything here runs on the training thread and only reads the training objects, except that
``compress_gradients`` puts back into each gradient the exact tensor it recorded and
``unscale_for_amp`` unscales the gradients as ``GradScaler.unscale_`` would. Writing the records
and checkpoints is the checkpoint session's business (lowdiff.persist.session).
"""
from __future__ import annotations

import warnings

import torch

from lowdiff.capture.betweensteps import changed_rng_sources
from lowdiff.capture.devicecopy import DeviceCopy
from lowdiff.distributed.ddp import AggregatedRecorder, CompressedAllReduce, is_ddp
from lowdiff.distributed.dtensors import local_chunk
from lowdiff.format import tree
from lowdiff.format.fullckpt import hidden_parameters
from lowdiff.format.records import StepRecord
from lowdiff.format.schema import TrainedWith
from lowdiff.step import boundary as capture
from lowdiff.step.compress import Compressed, compress_all, decompress_into

NO_GRAD = Compressed("none", 0, None)   # the record of a parameter without a gradient


def unwrapped_model(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DDP (or similar) wrapper holds in ``.module``; ``model`` itself otherwise."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


class StepCapture:
    """Captures, on the training thread, everything a step record or a full checkpoint holds.

    Call order within one ``step()``: ``check_untouched`` (from the second step on); then, before
    the optimizer step, ``unscale_for_amp``, ``hyperparameters`` and ``compress_gradients``; after
    the optimizer and scheduler steps, ``record``; ``full_checkpoint`` when one is due; and
    ``mark_state`` last, whatever happened. ``base_checkpoint`` serves the first step instead.

    Gradients are recorded by position in the optimizer's parameter list (its "slot"), so the
    parameter list must not change after construction.
    """

    def __init__(self, optimizer, model: torch.nn.Module, compressor, *, scheduler=None,
                 extra_state: dict | None = None, grad_scaler=None):
        self.optimizer = optimizer
        self.model = unwrapped_model(model)
        self.compressor = compressor
        self.scheduler = scheduler
        self.extra_state = dict(extra_state or {})
        self.grad_scaler = grad_scaler
        self.residuals: dict = {}               # error feedback, by slot (also under DDP)
        self.outside_changes = 0                # steps that found a parameter changed outside step()
        self._index_parameters()
        self._buffer_names = capture.persistent_buffer_names(self.model)
        self._recorder = self.compressor
        self._recorded_elsewhere: frozenset = frozenset()   # see record_only
        if is_ddp(model):
            # The comm hook compresses and exchanges the gradients; step() records what it returned.
            hook = CompressedAllReduce(self.compressor, self.residuals, params=self.params)
            model.register_comm_hook(hook, CompressedAllReduce.hook)
            self._recorder = AggregatedRecorder(sparse=self.compressor.name == "topk")
        # CUDA gradients: records reach the writer through pinned memory, without a sync in step().
        device = DeviceCopy.needed(self.params)
        self._device_copy = DeviceCopy(device) if device is not None else None
        self._base_boundary: dict | None = None  # see capture_base_boundary
        self._state_marks: list | None = None    # see _training_state_marks, at the last boundary

    def _index_parameters(self) -> None:
        """Slots, names and the model's state keys of the optimizer's parameters."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.param_names = [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(self.params)]
        slot_of = {id(p): i for i, p in enumerate(self.params)}
        live_state = self.model.state_dict(keep_vars=True)
        # Keys of the model's state that are optimizer parameters (tied weights appear under several).
        self.param_aliases = {k: slot_of[id(v)] for k, v in live_state.items() if id(v) in slot_of}
        # Parameters a state-dict hook replaced by other tensors (fused weights saved split): the
        # full checkpoints hold them under their own names too, or nothing could be replayed from
        # them without the model's code (an export). docs/format.md.
        self.hidden = hidden_parameters(self.model, self.params, live_state)
        self.param_aliases.update({name: slot_of[id(p)] for name, p in self.hidden.items()})
        self.foreign_keys = capture.trained_elsewhere(self.model, self.optimizer)

    def record_only(self, slots) -> None:
        """Record the gradients of ``slots`` only. Under DDP every rank holds the same aggregated
        gradient and a partitioned directory keeps each parameter's in one rank's share
        (lowdiff.distributed.partition): scanning the others' here would be thrown away at encoding. Outside
        DDP the compressor changes the gradient the optimizer consumes and runs on every slot."""
        if self._recorder is not self.compressor:
            self._recorded_elsewhere = frozenset(range(len(self.params))) - frozenset(slots)

    # ------------------------------------------------------------ before the optimizer step
    def unscale_for_amp(self, found_inf, grad_scale) -> bool:
        """With GradScaler (which sets ``found_inf``/``grad_scale`` on the optimizer it steps):
        unscale as GradScaler.unscale_ would and report whether the step is skipped."""
        if found_inf is None:
            return False
        if bool(found_inf.item()):
            return True
        if grad_scale is not None:
            inv_scale = grad_scale.double().reciprocal().float()
            by_device: dict = {}
            for g in (p.grad for p in self.params if p.grad is not None):
                by_device.setdefault((g.device, g.dtype), []).append(g)
            for (device, _), group in by_device.items():
                dummy = torch.zeros(1, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(group, dummy, inv_scale.to(device))
        return False

    def hyperparameters(self) -> list:
        """Copies of the param groups' hyper-parameters (what the optimizer step will use)."""
        return capture.hyperparameters(self.optimizer.param_groups)

    def compress_gradients(self) -> list:
        """Compress every gradient in parameter order and put back the exact tensor recorded."""
        for slot, p in enumerate(self.params):   # before any gradient or residual changes
            if p.grad is not None and p.grad.is_sparse:
                raise TypeError(f"parameter {self.param_names[slot]!r} has a sparse gradient; not supported")
        # A DTensor's gradient is recorded as its local chunk (what this rank's optimizer consumes).
        grads = [None if p.grad is None or slot in self._recorded_elsewhere else local_chunk(p.grad)
                 for slot, p in enumerate(self.params)]
        out = compress_all(self._recorder, grads, self.residuals)
        # Under DDP the comm hook already produced the gradient: it is recorded unchanged.
        if self._recorder is self.compressor:
            error_feedback = self.compressor.error_feedback
            for grad, compressed in zip(grads, out):
                if compressed is None or grad is None:
                    continue
                if compressed.kind == "sparse":
                    decompress_into(compressed, grad)
                elif error_feedback:
                    grad.view(-1).copy_(compressed.values)  # dense with error feedback: grad+residual
        return [NO_GRAD if compressed is None else compressed for compressed in out]

    # ------------------------------------------------------------ after the optimizer step
    def record(self, step: int, skipped: bool, grads: list | None, groups_used: list) -> StepRecord:
        """The record of ``step``, taken after the optimizer and scheduler steps: the gradients,
        the hyper-parameters used and those in force now, and the iteration-boundary objects."""
        objects = {"groups_used": groups_used,
                   "groups_after": capture.hyperparameters(self.optimizer.param_groups),
                   **self.capture_boundary()}
        if self.scheduler is not None:
            objects["scheduler"] = capture.state_dict_copy(self.scheduler)
        if self.grad_scaler is not None:
            objects["grad_scaler"] = {"state": self.grad_scaler.state_dict(), "found_inf": skipped}
        ready = None
        if grads and self._device_copy is not None:
            grads, ready = self._device_copy.to_host(grads)
        return StepRecord(step, skipped, grads or [], objects, ready)

    def capture_boundary(self) -> dict:
        """Copies of the small state at an iteration boundary: RNG states, extra_state, buffers.
        The RNG is left as captured: a ``state_dict()`` that draws from it (torchdata's
        StatefulDataLoader makes its iterator there, drawing the iterator's base seed from the
        global torch RNG) is lowdiff's reading, not the training's work. Left in place, that
        draw would happen at wrap in the uninterrupted run but after the restore in a resumed
        one, and the two runs' RNGs would part."""
        rng = capture.capture_rng()
        extra = capture.state_dicts(self.extra_state)
        if changed_rng_sources(rng):
            capture.restore_rng(rng)
        return {"rng": rng, "extra": extra, "buffers": capture.module_buffers(self.model, self._buffer_names)}

    # ------------------------------------------------------------ full checkpoints
    def capture_base_boundary(self) -> None:
        """Remember the boundary before the first step (at wrap, or the restored state at resume).
        The base checkpoint is taken inside that step's step(), after its forward pass drew random
        numbers, advanced the sampler and updated BatchNorm statistics: it needs the state before."""
        self._base_boundary = self.capture_boundary()

    @property
    def restored_boundary(self) -> dict:
        """The boundary ``capture_base_boundary`` took (at resume: the restored state), before the
        base checkpoint uses it."""
        assert self._base_boundary is not None
        return self._base_boundary

    def base_checkpoint(self) -> tuple[dict, TrainedWith]:
        """(state, meta) of the base checkpoint: the boundary from ``capture_base_boundary`` (used
        once) with the current parameters, optimizer, scheduler and grad scaler."""
        boundary, self._base_boundary = self._base_boundary, None
        assert boundary is not None, "capture_base_boundary() runs at wrap and at resume"
        boundary = {**boundary, "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}
        if self.grad_scaler is not None:
            # GradScaler.update() runs after step(): store the pre-update state and what update() needs.
            boundary["grad_scaler"] = {"state": self.grad_scaler.state_dict(), "found_inf": None}
        return self.full_checkpoint(boundary)

    def full_checkpoint(self, boundary: dict) -> tuple[dict, TrainedWith]:
        """(state, meta) of a full checkpoint at this iteration boundary. ``boundary`` holds the
        small objects captured there (a step's record has them), including copies of the buffers,
        which the next forward pass changes in place while the parameters and optimizer state
        are copied in the background. The tensors of ``state`` are the live ones, not copies."""
        state = {
            "model": {**capture.owned_model_state(self.model, self.foreign_keys, self.hidden), **boundary["buffers"]},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": boundary.get("scheduler"),
            "extra": boundary["extra"],
            "rng": boundary["rng"],
            "residuals": dict(self.residuals),
            "grad_scaler": boundary.get("grad_scaler"),
        }
        meta = TrainedWith(tuple(self.param_names), self.param_aliases,
                           f"{type(self.optimizer).__module__}.{type(self.optimizer).__qualname__}",
                           repr(self.compressor))
        return state, meta

    def state_nbytes(self) -> int:
        """About the payload of a full checkpoint: model and optimizer tensors, page-rounded."""
        tensors = list(capture.owned_model_state(self.model, self.foreign_keys, self.hidden).values())
        tensors += [v for state in self.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        tensors += list(self.residuals.values())
        memories = {tree.same_memory(t) or id(t): t for t in tensors}   # tied weights are stored once
        return sum(-(-t.numel() * t.element_size() // 4096) * 4096 for t in memories.values()) + (1 << 20)

    def restart(self, residuals: dict | None) -> None:
        """Continue from a restored state: its residuals (none: zero) and its boundary."""
        self.residuals.clear()  # in place: the DDP comm hook holds this dict
        self.residuals.update(residuals or {})
        self.capture_base_boundary()

    # ------------------------------------------------------------ changes outside step()
    def mark_state(self) -> None:
        """Remember the training state's marks at this iteration boundary (end of step())."""
        self._state_marks = self._training_state_marks()

    def check_untouched(self, step: int, force_full) -> None:
        """A parameter or optimizer tensor changed since ``mark_state`` (outside step()) is a
        change no differential holds: replay would miss it. Call ``force_full()`` (a full
        checkpoint at the end of this step makes resuming exact again), then warn, once.
        Call it directly from LowDiffOptimizer._step: the warning points at the user's step()."""
        if self._state_marks is None:
            return
        now = self._training_state_marks()
        if now is None or now == self._state_marks:
            return
        force_full()  # before the warning, which may be raised as an error
        self.outside_changes += 1
        if self.outside_changes == 1:
            changed = sorted({self._slot_name(slot) + ("" if key is None else f" (optimizer state {key!r})")
                              for slot, key, *_ in self._labelled(now) ^ self._labelled(self._state_marks)})
            shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
            warnings.warn(
                f"lowdiff: {shown} changed after step {step}, outside step(). "
                f"Differentials cannot replay that, so lowdiff takes a full checkpoint at the end of this step "
                f"(and after any further such change; this warning is shown once). Resuming at a step in "
                f"between would not match this run. Make such changes inside the optimizer step to keep "
                f"per-step checkpoints cheap.", RuntimeWarning, stacklevel=4)

    def _training_state_marks(self) -> list | None:
        """What changes whenever the parameters or the optimizer's tensors change: each parameter's
        version counter (bumped by in-place changes), then for each optimizer state tensor its
        parameter's id, key, identity (a tensor replaced, e.g. by load_state_dict) and version,
        flat in one list (two of these run every step: a list compares at a fraction of the cost
        of a set of tuples; ``_labelled`` turns it into those when a warning names the change).
        About 0.15 µs per tensor; None if a tensor keeps no version counter (inference tensors)."""
        try:
            marks: list = [p._version for p in self.params]
            for p, entries in self.optimizer.state.items():   # no Tensor.__hash__ call per parameter
                for key, v in entries.items():
                    if isinstance(v, torch.Tensor):
                        marks += (id(p), key, id(v), v._version)
        except RuntimeError:
            return None
        return marks

    def _labelled(self, marks: list) -> set:
        """``marks`` as {(slot, key, ...)}: key None for a parameter itself."""
        count = len(self.params)
        slot_of = {id(p): slot for slot, p in enumerate(self.params)}
        labelled = {(slot, None, version) for slot, version in enumerate(marks[:count])}
        labelled.update((slot_of.get(marks[i], -1), *marks[i + 1:i + 4]) for i in range(count, len(marks), 4))
        return labelled

    def _slot_name(self, slot: int) -> str:
        known = 0 <= slot < len(self.param_names)
        return self.param_names[slot] if known else "a tensor the optimizer no longer trains"
