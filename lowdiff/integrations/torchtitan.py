"""torchtitan's ``Trainer`` with lowdiff in place of its checkpoint manager (torchtitan 0.3.0).

torchtitan builds its checkpointer from ``Trainer.Config.checkpoint`` (any
``BaseCheckpointManager.Config``) after the model is parallelized (FSDP2) and the optimizer and LR
schedulers are built, and calls it at fixed points of ``Trainer.train``:

    checkpointer.load(step=config.checkpoint.load_step)      # before the data iterator is made
    for each step:  zero_grad -> forward/backward -> clip_grad_norm_ -> maybe_wait_for_staging()
                    -> optimizers.step() -> lr_schedulers.step() -> checkpointer.save(step)
    trainer.close() -> checkpointer.close()

``LowDiffCheckpointManager`` wraps torchtitan's optimizer (the one ``torch.optim`` optimizer inside
its ``OptimizersContainer``) with ``lowdiff.wrap(..., options=Options(boundary="manual"))`` and puts
the wrapped one back into the container, so ``optimizers.step()`` records the local gradient chunk
each rank's optimizer consumes (after the clipping). ``save()`` is the iteration boundary: the step
is recorded with the LR schedulers torchtitan has just stepped, the dataloader's position and the
trainer's counters (``step``, ``ntokens_seen``) as ``extra_state`` -- the same objects torchtitan's
own DCP manager saves. ``load()`` is ``recovery.resume``: every rank gets its own state back, bit
for bit, and ``Trainer.train`` continues from the restored ``step``.

    config = llama3_debugmodel()                      # any Trainer.Config
    config.checkpoint = LowDiffCheckpointManager.Config(full_every=100, batch_steps=10)
    trainer = config.build()
    trainer.train()                                    # resumes what dump_folder/lowdiff holds
    trainer.close()
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torchtitan.components.checkpointer import DATALOADER, LR_SCHEDULER, BaseCheckpointManager

import lowdiff

# BaseCheckpointManager.Config fields whose DCP meaning lowdiff does not carry out: a run configured
# with one of them would silently do something else than asked, so it is refused.
_NOT_HONOURED = {
    "initial_load_path": "start from a DCP checkpoint as docs/guide.md says (load it before the first step)",
    "initial_load_in_hf": "export the model from lowdiff's directory instead",
    "last_save_in_hf": "export the model with python -m lowdiff export instead",
    "create_seed_checkpoint": "create the seed checkpoint with torchtitan's own CheckpointManager",
    "load_only": "use torchtitan's own CheckpointManager to load without saving",
    "exclude_from_loading": "lowdiff restores the whole state or nothing",
}


class LowDiffCheckpointManager(BaseCheckpointManager):
    """A torchtitan checkpoint manager that records every step with lowdiff (a differential of the
    local gradient chunk each step, a full checkpoint of each rank's chunks every ``full_every``
    steps) under ``dump_folder/folder``, and resumes from its newest durable step."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):
        enable: bool = True
        folder: str = "lowdiff"
        """lowdiff's checkpoint directory, relative to the trainer's dump folder."""

        interval: int = 1
        """Not a save interval (every step is recorded): torchtitan's dataloader snapshots its
        workers' state every ``interval`` steps, so 1 keeps a position at every step."""

        initial_load_model_only: bool = False

        compressor: Literal["dense", "topk"] = "dense"
        """What a differential holds: "dense", the whole local gradient chunk; "topk", its largest
        ``topk_ratio`` elements (the optimizer then consumes exactly those)."""

        topk_ratio: float = 0.01
        full_every: int = 100
        """Steps between full checkpoints."""

        batch_steps: int = 10
        """Steps per differential batch file (what a SIGKILL may lose: about two batches)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            for name, instead in _NOT_HONOURED.items():
                if getattr(self, name):
                    raise ValueError(f"LowDiffCheckpointManager.Config({name}={getattr(self, name)!r}) is not "
                                     f"supported: {instead}")
            if self.compressor not in ("dense", "topk"):
                raise ValueError(f"LowDiffCheckpointManager.Config(compressor={self.compressor!r}): "
                                 f"'dense' or 'topk'")
            for name in ("full_every", "batch_steps"):
                if getattr(self, name) < 1:
                    raise ValueError(f"LowDiffCheckpointManager.Config({name}={getattr(self, name)!r}) must be >= 1")

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any = None,
                 base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        if len(model_parts) != 1:
            raise ValueError(f"LowDiffCheckpointManager records one model part; this run has {len(model_parts)} "
                             f"(pipeline parallelism), which lowdiff does not record yet: use torchtitan's "
                             f"CheckpointManager")
        inner = list(optimizers.optimizers)
        if len(inner) != 1:
            raise ValueError(f"LowDiffCheckpointManager records one optimizer; torchtitan built {len(inner)} "
                             f"({', '.join(type(o).__name__ for o in inner)}) from the param_groups of "
                             f"Trainer.Config.optimizer: give every group the same optimizer_name")
        self.directory = os.path.join(base_folder, config.folder)
        # Each LambdaLR torchtitan built, by itself: lowdiff sees that the optimizer's scheduler is
        # checkpointed (LRSchedulersContainer keeps only the first one's last_epoch).
        extra: dict[str, Any] = {f"{LR_SCHEDULER}.{i}": s for i, s in enumerate(lr_schedulers.schedulers)}
        extra.update(states)
        if dataloader is not None:
            extra[DATALOADER] = dataloader
        compressor = lowdiff.Dense() if config.compressor == "dense" else lowdiff.TopK(ratio=config.topk_ratio)
        retention = lowdiff.KeepLast(config.keep_latest_k) if config.keep_latest_k else lowdiff.KeepAll()
        self.optimizer = lowdiff.wrap(inner[0], model_parts[0], self.directory, compressor=compressor,
                                      full_every=config.full_every, batch_steps=config.batch_steps,
                                      extra_state=extra, retention=retention,
                                      options=lowdiff.Options(boundary="manual"))
        # OptimizersContainer.step() and zero_grad() go through this list: the wrapped optimizer
        # takes the inner one's place (the LR schedulers stay on the inner one; they share its
        # param_groups).
        optimizers.optimizers[0] = self.optimizer
        self.model = model_parts[0]
        self.resumed_step = 0

    def _load(self, step: int = -1) -> bool:
        import recovery  # a leaf module: recovery imports lowdiff, not the other way round

        self.resumed_step = int(recovery.resume(self.directory, self.model, self.optimizer,
                                                step=None if step == -1 else step))
        return self.resumed_step > 0

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        # The step torchtitan just took (optimizers.step(), lr_schedulers.step()) ends here.
        self.optimizer.boundary()
        if last_step:
            self.optimizer.flush()     # train() returns with the last step durable, as DCP's last save
        return True

    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: lowdiff's step() itself waits until a full checkpoint's copy is
        taken before the state changes."""

    def _wait_for_saving(self) -> None:
        self.optimizer.flush()

    def _close(self) -> None:
        self.optimizer.close()      # flush, wait, commit; releases the directory
