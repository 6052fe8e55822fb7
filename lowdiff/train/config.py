"""WrapConfig: the validated settings of one lowdiff.wrap call, resolved from its option objects
(lowdiff.train.options) into the flat record the session, the controller and the replica read; and the
checks of the objects handed to wrap()."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

import torch

from lowdiff.store.retention import KeepLast, Policy, check_policy


class Stateful(Protocol):
    """What ``extra_state`` values must have (check_wrap_arguments enforces it): lowdiff saves
    ``state_dict()`` at every step and hands it back to ``load_state_dict`` at resume."""

    def state_dict(self) -> Any: ...

    # Positional-only: implementations name the argument as they like (state, state_dict, sd).
    def load_state_dict(self, state_dict: Any, /) -> object: ...


class Scheduler(Stateful, Protocol):
    """What a ``scheduler`` must have: a stateful object that ``step()`` steps without arguments
    after each optimizer step (torch's LR schedulers, except ReduceLROnPlateau, which needs a metric)."""

    def step(self) -> object: ...


@dataclasses.dataclass(frozen=True)
class WrapConfig:
    """full_every / batch_steps: an int, or "auto" to let the controller choose from measured costs.
    max_pending_batches: how many batches may be recorded but not yet durable before step() blocks;
    a SIGKILL loses at most about that many batches of steps. failure_rate_per_hour, max_recovery_s
    (a bound on load + replay at resume, None: none) and batch_memory_bytes (records held before
    they are durable) are what the controller's choices for "auto" must respect (docs/controller.md).
    differentials: True records every step (the per-step promise); False, full checkpoints only (a
    crash loses the steps since the last one); "auto" lets the controller turn them off while they
    cost more than they save, and on again (the user's explicit consent to lose up to full_every
    steps meanwhile)."""

    full_every: int | str = 100
    batch_steps: int | str = 10
    retention: Policy = KeepLast(2)   # what the main directory keeps (lowdiff.store.retention)
    max_pending_batches: int = 2
    overwrite: bool = False
    full_copy: str = "background"       # Options.full_copy: "background" or "in_step"
    failure_rate_per_hour: float = 0.1
    max_recovery_s: float | None = None
    batch_memory_bytes: int = 256 * 2**20
    boundary: str = "step"    # "step": the end of opt.step(); "manual": opt.boundary()
    replica: bool = False     # replica mode (LowDiff+, lowdiff.persist.replica)
    replica_inflight_steps: int = 2   # replica mode: captured steps not yet applied before step() waits
    replica_inexact_gpu: bool = False  # replica mode: a CPU replica of a GPU model accepted (Replica.allow_inexact_gpu)
    tiers: Any = None         # lowdiff.tiers.Tiers: stage to a shared directory (None: one directory)
    differentials: bool | str = True   # record every step; False: full checkpoints only; "auto"
    stripe_dirs: tuple = ()   # other devices' directories full checkpoints are striped over (Options.stripe_dirs)

    def __post_init__(self):
        for name in ("full_every", "batch_steps"):
            value = getattr(self, name)
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int or 'auto'")
        check_policy("retention", self.retention)
        if self.max_pending_batches < 1:
            raise ValueError(f"max_pending_batches={self.max_pending_batches!r} must be >= 1")
        if not self.failure_rate_per_hour > 0:
            raise ValueError(f"failure_rate_per_hour={self.failure_rate_per_hour!r} must be > 0")
        if self.max_recovery_s is not None and not self.max_recovery_s > 0:
            raise ValueError(f"max_recovery_s={self.max_recovery_s!r} must be > 0 or None")
        if self.boundary not in ("step", "manual"):
            raise ValueError(f"boundary={self.boundary!r} must be 'step' (the end of opt.step()) or 'manual' "
                             f"(opt.boundary())")
        if not self.batch_memory_bytes > 0:
            raise ValueError(f"batch_memory_bytes={self.batch_memory_bytes!r} must be > 0")
        if self.replica_inflight_steps < 1:
            raise ValueError(f"replica_inflight_steps={self.replica_inflight_steps!r} must be >= 1")
        if not (isinstance(self.differentials, bool) or self.differentials == "auto"):
            raise ValueError(f"differentials={self.differentials!r} must be True, False or 'auto'")
        if self.replica and self.differentials is not True:
            raise ValueError(f"differentials={self.differentials!r} is not supported with replica=True (replica "
                             f"mode writes the differentials a persisted replica does not cover, and only those)")
        if self.replica and self.full_every == "auto":
            raise ValueError("full_every='auto' is not supported with replica=True: give how many steps apart "
                             "the replica is persisted (1: as often as the disk allows)")


def check_wrap_arguments(optimizer, model, directory, compressor, scheduler, extra_state) -> None:
    """Refuse, with a message naming the argument, objects lowdiff.wrap cannot checkpoint exactly."""
    from lowdiff.step.compress import Dense, TopK

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(directory, (str, bytes, os.PathLike)):
        raise TypeError(f"directory must be a path, got {type(directory).__name__}")
    if compressor is not None and not isinstance(compressor, (Dense, TopK)):
        raise TypeError(f"compressor must be lowdiff.TopK(...) or lowdiff.Dense(), got {compressor!r}")
    if scheduler is not None:
        if not all(hasattr(scheduler, name) for name in ("step", "state_dict", "load_state_dict")):
            raise TypeError(f"scheduler ({type(scheduler).__name__}) has no step()/state_dict()/load_state_dict()")
        if getattr(scheduler, "optimizer", optimizer) is not optimizer:
            raise ValueError("scheduler belongs to another optimizer: build it on the optimizer you pass to wrap()")
    if extra_state is not None and not isinstance(extra_state, dict):
        raise TypeError(f"extra_state must be a dict of name -> object, got {type(extra_state).__name__}")
    for name, obj in (extra_state or {}).items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            hint = ""
            if isinstance(obj, (torch.utils.data.Sampler, torch.utils.data.DataLoader)):
                # The data position is what the user wanted saved: say what saves it.
                hint = (": to save the data order, pass lowdiff.ResumableLoader(DataLoader(...)) instead (it "
                        "continues at the exact next batch after a resume)")
            raise TypeError(f"extra_state[{name!r}] ({type(obj).__name__}) has no state_dict()/load_state_dict(){hint}")
    owned = {id(p) for p in _unwrapped(model).parameters()}
    for index, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        if id(p) not in owned:
            raise ValueError(f"parameter #{index} of the optimizer ({tuple(p.shape)}) is not a parameter of the "
                             f"model: its value would not be checkpointed; register it in the model")


def _unwrapped(model):
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model
