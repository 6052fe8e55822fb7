"""lowdiff.capture.gradhooks: layer-wise gradient capture for replica mode (LowDiff+). Each parameter's
gradient is copied into staging memory by a post-accumulate-grad hook as soon as autograd has
finished accumulating it, so the copies overlap the rest of backward instead of running in step().

Staging is a pool of gradient sets (one tensor per parameter each). The training thread fills
the *current* set during backward; ``take()`` at ``step()`` hands it over (to the replica worker,
which gives it back when it has applied the step, and to the differential writer, which gives it
back when the step's record is written or no longer needed: the set is free when both have) and
``acquire()`` makes a free set current, allocating one when none is free. The pool therefore grows
to what the holders keep at most; those bound it (lowdiff.persist.replica bounds the steps not yet
applied, the differential writer the records not yet durable) and make training wait.

Exactness: the record must be exactly the tensor the optimizer consumes. Autograd accumulation
bumps a gradient's version counter, and so does anything done to it after backward (clipping,
AMP unscaling, a DDP all-reduce into bucket views). Each hook copy is stamped with the gradient
tensor and its version; ``take()`` re-copies any gradient whose stamp no longer matches, so the
staged copy is always the final gradient — also under gradient accumulation, where the hook fires
once per micro-batch and the last copy wins.
"""
from __future__ import annotations

import threading

import torch

from lowdiff.step.compress import Compressed

NO_GRAD = Compressed("none", 0, None)


class GradientSet:
    """Staging for one step's gradients: a flat tensor per parameter, and per parameter the
    (gradient tensor, version) its copy was taken from, or None if it was not copied yet."""

    def __init__(self, params: list, pinned: bool):
        self.values = [torch.empty(p.numel(), dtype=p.dtype, device="cpu", pin_memory=pinned) for p in params]
        self.stamps: list[tuple | None] = [None] * len(params)
        self.copied: torch.cuda.Event | None = None   # CUDA: recorded on the side stream after the last copy
        self.users = 1    # readers that have not given it back yet (the replica worker, the diff writer)

    def reset(self) -> None:
        self.stamps = [None] * len(self.stamps)
        self.copied = None
        self.users = 1


class GradientStaging:
    """Post-accumulate-grad hooks on ``params`` (param_groups order) and a pool of gradient sets
    (``sets`` allocated up front, more when needed). Training thread: backward (hooks) ->
    ``take()`` in step() -> ``acquire()`` once the taken set is handed over. Any thread:
    ``give_back(set)``. ``close()`` removes the hooks."""

    def __init__(self, params: list, sets: int, hooks: bool = True):
        """``hooks=False``: no layer-wise capture, ``take()`` copies every gradient (under DDP the
        gradient the optimizer consumes is the all-reduced one, written into ``.grad`` at the end
        of backward, after the hooks fired on the local one)."""
        if sets < 1:
            raise ValueError(f"sets={sets} must be >= 1")
        self.params = params
        self._pinned = any(p.device.type == "cuda" for p in params)
        # A GPU gradient goes to pinned host memory on a side stream, overlapping backward's kernels.
        self._stream = torch.cuda.Stream() if self._pinned else None
        self._free = [GradientSet(params, pinned=self._pinned) for _ in range(sets)]
        self._lock = threading.Lock()
        self.allocated = sets      # sets in existence (the pool's high-water mark)
        self.current: GradientSet | None = None
        self.hook_copies = 0       # gradients staged by a hook and used as is
        self.step_copies = 0       # gradients (re)copied in step(): changed after backward, or no hook ran
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(slot))
                         for slot, p in enumerate(params)] if hooks else []
        self.acquire()

    def _hook_for(self, slot: int):
        def hook(param: torch.Tensor) -> None:
            gset, grad = self.current, param.grad
            if gset is None or grad is None or grad.is_sparse:
                return   # take() copies it (or refuses a sparse gradient)
            self._copy(gset, slot, grad)
        return hook

    def _copy(self, gset: GradientSet, slot: int, grad: torch.Tensor) -> None:
        dst = gset.values[slot].view(grad.shape)
        with torch.no_grad():
            if grad.device.type == "cuda" and self._stream is not None:
                # The side stream waits for the kernels that produced grad, then copies into pinned
                # memory without blocking the compute stream; grad must outlive the copy.
                self._stream.wait_stream(torch.cuda.current_stream(grad.device))
                with torch.cuda.stream(self._stream):
                    dst.copy_(grad, non_blocking=True)
                    grad.record_stream(self._stream)
                event = torch.cuda.Event()
                event.record(self._stream)
                gset.copied = event
            else:
                dst.copy_(grad)
        gset.stamps[slot] = (grad, grad._version)

    def take(self) -> tuple[GradientSet, list[Compressed]]:
        """At step(), before the optimizer step: the current set, completed with every gradient a
        hook did not stage as it is now, and the dense records (views of the set) of each
        parameter. The set is no longer current: hand it over, then ``acquire()``."""
        gset = self.current
        if gset is None:
            gset = self.acquire()
        for slot, p in enumerate(self.params):   # before anything is copied
            if p.grad is not None and p.grad.is_sparse:
                raise TypeError(f"parameter #{slot} has a sparse gradient; replica mode records dense gradients")
        grads = []
        for slot, p in enumerate(self.params):
            grad = p.grad
            if grad is None:
                grads.append(NO_GRAD)
                continue
            stamp = gset.stamps[slot]
            if stamp is not None and stamp[0] is grad and stamp[1] == grad._version:
                self.hook_copies += 1
            else:
                self.step_copies += 1
                self._copy(gset, slot, grad)
            grads.append(Compressed("dense", grad.numel(), gset.values[slot]))
        if gset.copied is not None:
            gset.copied.synchronize()   # the replica worker reads the host copies
        gset.reset()   # drop the references to the gradients (stamps) now
        self.current = None
        return gset, grads

    def acquire(self) -> GradientSet:
        """Make a free set current (a new one when none is free)."""
        with self._lock:
            gset = self._free.pop() if self._free else None
            if gset is None:
                self.allocated += 1
        if gset is None:
            gset = GradientSet(self.params, pinned=self._pinned)
        gset.reset()
        self.current = gset
        return gset

    def lend(self, gset: GradientSet) -> None:
        """One more holder of ``gset`` (called by a holder), who will ``give_back`` too."""
        with self._lock:
            gset.users += 1

    def give_back(self, gset: GradientSet) -> None:
        """One of the set's ``users`` is done with it; the last one frees it."""
        with self._lock:
            gset.users -= 1
            if gset.users == 0:
                self._free.append(gset)

    def in_use(self) -> int:
        """Sets neither free nor current: handed over and not given back by every holder yet."""
        with self._lock:
            return self.allocated - len(self._free) - (self.current is not None)

    def close(self) -> None:
        """Remove the hooks (idempotent)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.current = None
