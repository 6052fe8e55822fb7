"""PyTorch Lightning with per-step lowdiff checkpoints and ``ckpt_path``-like resume.

``configure_optimizers`` returns the plain optimizer and its schedulers, as in any Lightning
module. ``LowDiffCallback`` wraps the optimizer in ``on_fit_start`` (after Lightning set it up and
checked that each scheduler belongs to a returned optimizer: a scheduler is bound to the optimizer
it was built on, and Lightning compares by identity, which is why returning ``lowdiff.wrap(opt)``
with a scheduler built on ``opt`` is refused), swaps the wrapped one into the strategy, and resumes
from the newest durable step in the same hook, before the fit loop runs.

The iteration boundary is ``on_train_batch_end``: Lightning has stepped the optimizer and its
step- and epoch-interval schedulers, and its progress counters are in the state its own
``ModelCheckpoint(every_n_train_steps=...)`` saves there, so restoring the fit loop's state makes
Lightning continue with the next batch, with its global step and epoch. The data position: a
``lowdiff.ResumableLoader`` returned by ``train_dataloader`` is saved in the fit loop's state, as
Lightning does for stateful loaders, with the number of batches Lightning trained in the epoch (its
fetcher reads a batch ahead, so the loader's own count is one too many); Lightning loads it
before the loader's first ``iter()``.

    trainer = L.Trainer(max_steps=1000, callbacks=[LowDiffCallback("runs/ckpt", full_every=50)])
    trainer.fit(module)        # resumes what runs/ckpt holds; the callback closes lowdiff at the end
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl

import lowdiff
from lowdiff.integrations import manual_boundary, refuse_fixed_options


class LowDiffCallback(pl.Callback):
    """Checkpoint every training step through lowdiff under ``directory`` and resume from it at
    the start of ``fit``. ``wrap_options`` go to ``lowdiff.wrap`` (``compressor``, ``full_every``...)."""

    def __init__(self, directory: str | os.PathLike[str], **wrap_options: Any) -> None:
        refuse_fixed_options(wrap_options, ("boundary", "scheduler", "extra_state"),
                             "Lightning steps the schedulers and the boundary is on_train_batch_end")
        self.directory = os.fspath(directory)
        self.wrap_options = wrap_options
        self.optimizer: lowdiff.LowDiffOptimizer | None = None
        self.resumed_step = 0
        self._loop: dict[str, Any] = {}        # the fit loop's state at the last boundary
        self._warned_data = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import recovery  # a leaf module: recovery imports lowdiff, not the other way round

        if len(trainer.optimizers) != 1:
            raise ValueError(f"LowDiffCallback checkpoints one optimizer; configure_optimizers returned "
                             f"{len(trainer.optimizers)}")
        inner = trainer.optimizers[0]
        extra: dict[str, Any] = {f"scheduler{i}": config.scheduler
                                 for i, config in enumerate(trainer.lr_scheduler_configs)}
        extra["lightning"] = self
        self.optimizer = lowdiff.wrap(inner, pl_module, self.directory, extra_state=extra,
                                      **manual_boundary(self.wrap_options))
        trainer.strategy.optimizers = [self.optimizer]
        self.resumed_step = int(recovery.resume(self.directory, pl_module, self.optimizer))
        if self.resumed_step and self._loop:
            trainer.fit_loop.load_state_dict(self._loop)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self.optimizer is not None
        loop = trainer.fit_loop.state_dict()
        self._correct_data_position(trainer.train_dataloader, loop, batch_idx)
        self._loop = loop
        self.optimizer.boundary()

    def _correct_data_position(self, loader: Any, loop: dict[str, Any], batch_idx: int) -> None:
        """Lightning saves a stateful loader's state with the fit loop and loads it before the
        loader's first ``iter()``; but its fetcher has read a batch ahead, so the loader's count
        is one too many. The position is the number of batches trained in the epoch."""
        states = loop.get("state_dict", {}).get("combined_loader")
        if isinstance(loader, lowdiff.ResumableLoader) and states and len(states) == 1:
            states[0]["position"] = batch_idx + 1
            return
        if not self._warned_data:
            self._warned_data = True
            warnings.warn(f"lowdiff: train_dataloader returned a {type(loader).__name__}, whose position is not "
                          f"saved: a resumed run would not continue with the exact next batch. Return one "
                          f"lowdiff.ResumableLoader(DataLoader(...))", RuntimeWarning, stacklevel=2)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.optimizer is not None:
            self.optimizer.close()      # flush and release the directory: fit() returns durable

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.optimizer is not None:
            self.optimizer.close()

    # -------------------------------------------------------------- extra_state protocol
    def state_dict(self) -> dict[str, Any]:
        return {"loop": self._loop}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loop = state_dict["loop"]


