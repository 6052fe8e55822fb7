"""recovery.resume: restore live training objects to the newest durable step."""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from lowdiff import LowDiffOptimizer
from lowdiff.distributed.ddp import distributed_rank
from lowdiff.distributed.dtensors import grad_targets, local_chunk
from lowdiff.distributed.partition import is_partitioned
from lowdiff.errors import CheckpointError
from lowdiff.format.container import KIND_DIFF_SHARE, KIND_FULL_SHARE, file_kind
from lowdiff.format.fullckpt import live_targets
from lowdiff.step import boundary as capture
from lowdiff.store.rankdirs import rank_directories, rank_directory
from lowdiff.train.config import Scheduler, Stateful
from recovery.compat import check_compatible
from recovery.execute import Restored
from recovery.partitioned.restore import restore_partitioned
from recovery.pipeline.replay import check_workers
from recovery.plan import checkpoint_directory, warn
from recovery.restore import execute_directory, plan_directory, planned_step
from recovery.tiers import object_store_of, restore_from_tiers, shared_tier


def restore_grad_scaler(scaler, stored) -> None:
    """Load a GradScaler's pre-update state and redo the update() that followed that step."""
    if scaler is None or stored is None:
        return
    state = dict(stored["state"])
    if stored["found_inf"] is not None and state:
        scale = torch.tensor([state["scale"]], dtype=torch.float32)
        tracker = torch.tensor([state["_growth_tracker"]], dtype=torch.int32)
        found = torch.tensor([1.0 if stored["found_inf"] else 0.0])
        torch._amp_update_scale_(scale, tracker, found, state["growth_factor"], state["backoff_factor"],
                                 state["growth_interval"])
        state["scale"], state["_growth_tracker"] = scale.item(), int(tracker.item())
    scaler.load_state_dict(state)

SHARE_KINDS = (KIND_FULL_SHARE, KIND_DIFF_SHARE)


def apply_boundary(boundary, model, scheduler, extra_state: dict, grad_scaler, where: str) -> None:
    """Restore what the iteration boundary holds besides parameters and optimizer state."""
    capture.restore_buffers(model, boundary.buffers)
    if boundary.rng:   # empty for a rank that did not exist when a partitioned set was saved
        capture.restore_rng(boundary.rng)
    if scheduler is not None and boundary.scheduler is not None:
        scheduler.load_state_dict(boundary.scheduler)
    capture.load_state_dicts(extra_state, boundary.extra, where)
    restore_grad_scaler(grad_scaler, boundary.grad_scaler)


def _agree(step: int) -> tuple[int, int]:
    """(min, max) of ``step`` over all ranks."""
    values = torch.tensor([step, -step], dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return int(values[0]), int(-values[1])


class Resumed(int):
    """What ``resume`` returns: the number of completed steps (an int, usable as ``range(start,
    ...)``), with what recovery did as attributes:

    ``full_step``/``full_file`` the full checkpoint it started from (-1/"" when there was none);
    ``replayed`` how many differentials it applied; ``skipped`` ((file, why), ...) newer full
    checkpoints it could not use; ``abandoned`` newer steps of the directory it did not go to (they
    are dropped when a wrapped optimizer commits its first full checkpoint); ``load_s``,
    ``read_s``, ``decode_s``, ``apply_s`` where the time went (seconds; read and decode overlap
    the apply) and ``replay_s`` the wall-clock time of the replay; with storage tiers, ``tier``
    ("local" or "shared") and ``directory`` say where the state came from ("" without tiers).
    """

    full_step: int
    full_file: str
    replayed: int
    skipped: tuple
    abandoned: tuple
    load_s: float
    read_s: float
    decode_s: float
    apply_s: float
    replay_s: float
    tier: str
    directory: str

    def __new__(cls, step: int, restored: Restored | None = None) -> Resumed:
        self = super().__new__(cls, step)
        times = getattr(restored, "times", None)
        self.full_step = restored.full_step if restored else -1
        self.full_file = restored.full_file if restored else ""
        self.replayed = step - restored.full_step if restored else 0
        self.skipped = tuple(restored.skipped) if restored else ()
        newest = restored.newest_step if restored else -1
        self.abandoned = (step + 1, newest) if newest > step else ()
        self.load_s = restored.load_s if restored else 0.0
        self.read_s, self.decode_s, self.apply_s = ((times.read_s, times.decode_s, times.apply_s) if times
                                                    else (0.0, 0.0, 0.0))
        self.replay_s = getattr(times, "wall_s", 0.0)
        self.tier, self.directory = "", restored.directory if restored else ""
        return self

    def __str__(self) -> str:
        # The number, as the plain int resume() used to return: f"{step}" and print(step) must not
        # show the repr (the demo's "resumed at step N" line is parsed by scripts and tests).
        return int.__repr__(self)

    def __repr__(self) -> str:
        return (f"Resumed(step={int(self)}, full_step={self.full_step}, replayed={self.replayed}, "
                f"skipped={len(self.skipped)}, abandoned={self.abandoned})")


def resume(directory: str | os.PathLike[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
           step: int | None = None, workers: int | None = None, scheduler: Scheduler | None = None,
           extra_state: dict[str, Stateful] | None = None, grad_scaler: torch.amp.GradScaler | None = None,
           shared_dir: str | os.PathLike[str] | None = None) -> Resumed:
    """Restore ``model``, ``optimizer``, RNG states, scheduler and extra_state to the newest durable
    step under ``directory`` — or, with ``step=K``, to the state after any retained step K ("time
    travel") — and return that step (0 for a missing or empty directory) as a ``Resumed``.

    ``optimizer`` is normally the object ``lowdiff.wrap`` returned (its scheduler, extra_state and
    grad_scaler are restored too, and it continues recording after the returned step); a plain
    optimizer works as well, with scheduler/extra_state passed here. A K that is not retained
    raises NoCheckpointError stating what is. Resuming a wrapped optimizer before the newest step
    abandons the steps after it (a warning says which).

    ``workers`` threads read and decode differentials ahead of the apply (default: the machine's
    cores but the applying one, see recovery.pipeline.replay.default_workers); any count gives the same bytes.

    Error-feedback residuals of a TopK compressor are per-rank and cannot be rebuilt from the
    aggregated differentials: they are restored when the resumed step is a full checkpoint's
    step and reset to zero otherwise (with a warning).

    Storage tiers: with ``shared_dir`` (or a wrapped optimizer with one, or a directory whose
    ``TIERS.json`` names one) both tiers are looked at and the newest state that verifies is
    restored, the local tier's when both reach the same step (recovery.tiers); ``Resumed.tier``
    says which.
    """
    directory = checkpoint_directory(directory)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be a step number >= 0, or None for the newest")
    check_workers(workers)
    targets = _Targets.of(model, optimizer, scheduler, extra_state, grad_scaler)
    shared = shared_tier(directory, targets.wrapper, shared_dir)
    tier = ""
    if shared is None:
        restored, own = _restore_any_layout(directory, targets, step, workers)
    else:
        restored, tier, own = restore_from_tiers(
            directory, shared, check_full=targets.check_full, stop_step=step, apply_full=targets.apply_full,
            params_for=targets.params, optimizer_for=lambda index: targets.inner, workers=workers,
            into=targets.live_tensors, object_store=object_store_of(targets.wrapper))
    wrapper = targets.wrapper
    if restored is None:
        if wrapper is not None:
            wrapper.continue_after(0)
            wrapper.controller.resumed(0.0, 0.0, 0)   # the start-up time of a first run is a restart's too
        return Resumed(0)
    apply_boundary(restored.boundary, targets.model, targets.scheduler, targets.extra_state if own else {},
                   targets.grad_scaler, f"step {restored.step} of {directory}")
    residuals = restored.full_state.residuals
    if restored.last_record is not None and residuals:
        warn(f"lowdiff: error-feedback residuals are reset to zero: step {restored.step} is not a full "
             f"checkpoint step (the residual of step {restored.full_step} would be stale)")
        residuals = {}
    params = [p for group in targets.inner.param_groups for p in group["params"]]
    if any(int(k) >= len(params) or v.numel() != local_chunk(params[int(k)]).numel() for k, v in residuals.items()):
        warn(f"lowdiff: error-feedback residuals are reset to zero: they were kept for other chunks of the "
             f"sharded parameters (the checkpoint of step {restored.full_step} was written at another world size)")
        residuals = {}
    result = Resumed(restored.step, restored)
    result.tier = tier
    if wrapper is not None:
        if result.abandoned:
            warn(f"lowdiff: resuming {directory} at step {restored.step} abandons steps "
                 f"{result.abandoned[0]}..{result.abandoned[1]}: training on writes a new timeline from step "
                 f"{restored.step}, and its first full checkpoint drops the old one's files")
        wrapper.continue_after(restored.step, {int(k): v.clone() for k, v in residuals.items()})
        # What this restart cost, for the controller's model (kept in CONTROLLER.json).
        wrapper.controller.resumed(result.load_s, result.replay_s, result.replayed if result.replay_s > 0 else 0)
    return result


@dataclasses.dataclass(frozen=True)
class _Targets:
    """The live objects resume restores (a wrapper supplies what the caller did not pass)."""

    model: torch.nn.Module
    inner: torch.optim.Optimizer
    wrapper: LowDiffOptimizer | None
    scheduler: object
    extra_state: dict
    grad_scaler: object

    @classmethod
    def of(cls, model, optimizer, scheduler, extra_state, grad_scaler) -> _Targets:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be the optimizer lowdiff.wrap returned (or a torch.optim.Optimizer), "
                            f"got {type(optimizer).__name__}")
        wrapper = optimizer if isinstance(optimizer, LowDiffOptimizer) else None
        if wrapper is not None:
            _check_scheduler_was_wrapped(scheduler, wrapper)
            scheduler = scheduler or wrapper.scheduler
            extra_state = extra_state or wrapper.extra_state
            grad_scaler = grad_scaler or wrapper.grad_scaler
        inner = model.module if hasattr(model, "module") and isinstance(model.module, torch.nn.Module) else model
        return cls(inner, wrapper.optimizer if wrapper else optimizer, wrapper, scheduler, extra_state or {},
                   grad_scaler)

    def check_full(self, path, index, state) -> None:
        check_compatible(path, index, state, self.model, self.inner,
                         compressor=self.wrapper.compressor if self.wrapper else None, extra_state=self.extra_state)

    def apply_full(self, index, state) -> None:
        # Parameters another optimizer trains are that optimizer's directory's to restore
        # (check_full made sure everything else is there).
        foreign = capture.trained_elsewhere(self.model, self.inner)
        self.model.load_state_dict({k: v for k, v in state.model.items() if k not in foreign}, strict=not foreign)
        self.inner.load_state_dict(state.optimizer)

    def live_tensors(self) -> dict:
        """The live tensors a full checkpoint is read straight into (``fullckpt.live_targets``),
        without the parameters another optimizer's directory restores."""
        return live_targets(self.model, self.inner, exclude=capture.trained_elsewhere(self.model, self.inner))

    def params(self, index) -> list:
        # A DTensor parameter's recorded gradient is its local chunk: replay sets it through the
        # parameter's LocalGradTarget, which hands the optimizer the DTensor around it.
        return grad_targets([p for group in self.inner.param_groups for p in group["params"]])


def _check_scheduler_was_wrapped(scheduler, wrapper: LowDiffOptimizer) -> None:
    """A wrapped optimizer's checkpoints hold the scheduler given to ``wrap`` (or those in its
    extra_state); one given only here has no state in them and would silently restore nothing."""
    if scheduler is None or wrapper.scheduler is not None:   # another one is loaded with the wrapped one's state
        return
    if any(scheduler is obj for obj in wrapper.extra_state.values()):
        return
    raise ValueError(f"recovery.resume(scheduler={type(scheduler).__name__}): lowdiff.wrap was given no scheduler, so "
                     f"the checkpoints hold no state of this one and resume would restore nothing into it. Pass it "
                     f"to lowdiff.wrap(..., scheduler=...) (or in extra_state) and call recovery.resume(dir, model, "
                     f"opt) without it")


def _restore_any_layout(directory: str, targets: _Targets, step: int | None, workers: int | None):
    """(Restored or None, whether this rank got its own per-rank state back). A partitioned
    directory is restored at any world size (recovery.partitioned.restore); else, the single-process layout
    (on every rank alike, with a warning when there are several), or rank directories of whole
    checkpoints that lowdiff wrote before partitioning existed."""
    rank, world = distributed_rank()
    if is_partitioned(directory):
        restored, own = restore_partitioned(directory, check_full=targets.check_full, apply_full=targets.apply_full,
                                            params_for=targets.params, optimizer_for=lambda index: targets.inner,
                                            stop_step=step, workers=workers, into=targets.live_tensors)
        if restored is not None:
            if world > 1:
                low, high = _agree(restored.step)
                if low != high:
                    raise CheckpointError(f"{directory}: ranks restored different steps ({low}..{high})")
            return restored, own
    restored = _restore_agreed(directory, targets, world, step, workers)
    if restored is None and world > 1 and is_partitioned(directory):
        if _agree(int(_holds_shares(directory)))[1]:
            # Shares but no complete set (a power loss during the first set's commit: one rank's
            # share renamed in, another's not): nothing to restore; the rank directories are not
            # whole checkpoints of the layout before partitioning, whose files would not verify.
            return None, True
        return _restore_agreed(rank_directory(directory, rank), targets, world, step, workers), True
    if restored is not None and world > 1 and rank == 0:
        warn(f"lowdiff: {directory} was written by a single process: every rank resumes its state, including "
             f"its RNG and extra_state")
    return restored, True


def _holds_shares(directory: str) -> bool:
    """Whether any rank directory this rank sees holds a share (a partitioned run wrote it)."""
    for path in rank_directories(directory).values():
        for name in os.listdir(path):
            if name.startswith(("full-", "diff-")) and file_kind(os.path.join(path, name)) in SHARE_KINDS:
                return True
    return False


def _restore_agreed(directory: str, targets: _Targets, world: int, step: int | None, workers: int | None):
    """Plan and execute. With several ranks, the ranks agree on the plan before anything changes:
    each plans, and while their plans reach different steps, all plan again at the smallest. A
    replay that then ends short of the plan on some rank (a record failed to verify there) makes
    them go again at the smallest step all reached."""
    stop_step = step
    for _ in range(3):
        plan = plan_directory(directory, check_full=targets.check_full, stop_step=stop_step)
        if world > 1:
            low, high = _agree(planned_step(plan))
            if low != high:
                if plan is not None:
                    plan.close()
                if low == 0:
                    raise CheckpointError(f"{directory}: some ranks have no checkpoint to resume from while "
                                          f"others reach step {high}")
                stop_step = low
                continue
        restored = None if plan is None else execute_directory(
            plan, check_full=targets.check_full, apply_full=targets.apply_full, params_for=targets.params,
            optimizer_for=lambda index: targets.inner, workers=workers, into=targets.live_tensors,
            early_params=lambda: targets.params(None))
        if world == 1:
            return restored
        low, high = _agree(restored.step if restored else 0)
        if low == high:
            return restored
        if low == 0:
            raise CheckpointError(f"{directory}: some ranks have no checkpoint to resume from while "
                                  f"others reach step {high}")
        stop_step = low
    raise CheckpointError(f"ranks could not agree on a step to resume from (last try: {low}..{high})")
