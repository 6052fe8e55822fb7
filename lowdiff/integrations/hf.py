"""Hugging Face ``Trainer`` with per-step lowdiff checkpoints and exact resume.

Trainer's inner loop per update step: ``optimizer.step()`` -> ``lr_scheduler.step()`` ->
``state.global_step += 1`` -> callbacks' ``on_step_end``. So the optimizer is wrapped with
``options=lowdiff.Options(boundary="manual")`` and ``LowDiffCallback.on_step_end`` calls
``opt.boundary()``: the step is recorded with the scheduler Trainer just stepped, the RNG as the
next step starts from it, and Trainer's own state (global step, epoch, log history), which the
callback saves as an ``extra_state`` object.

Resume goes through Trainer's own ``resume_from_checkpoint``, which owns the data position (it
fast-forwards the dataloader past the consumed batches of the interrupted epoch with accelerate's
``skip_first_batches``, the shuffle order coming from the sampler's per-epoch seed) and restores
the RNG after that skip. ``resume()`` restores everything from lowdiff's directory, then writes a
small folder in Trainer's checkpoint layout holding what Trainer reads back: ``trainer_state.json``,
``rng_state.pth`` (the restored RNG) and the model weights (the restored ones, which Trainer loads
again: the same bytes). Optimizer and scheduler files are left out on purpose, so Trainer keeps the
states lowdiff restored.

    callback = LowDiffCallback("runs/ckpt", full_every=50)
    opt = callback.wrap(torch.optim.AdamW(model.parameters(), lr=1e-3), model, scheduler=sched)
    trainer = Trainer(model, args, train_dataset=data, optimizers=(opt, sched), callbacks=[callback])
    trainer.train(resume_from_checkpoint=callback.resume(trainer))
    opt.close()
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

import lowdiff
from lowdiff.integrations import manual_boundary, refuse_fixed_options

RESUME_FOLDER = "lowdiff-resume"


class LowDiffCallback(TrainerCallback):
    """Marks lowdiff's iteration boundary after each Trainer update step and saves Trainer's state
    with it. ``wrap_options`` go to ``lowdiff.wrap`` (``compressor``, ``full_every``, ...)."""

    def __init__(self, directory: str | os.PathLike[str], **wrap_options: Any) -> None:
        refuse_fixed_options(wrap_options, ("boundary", "scheduler"), "Trainer steps the scheduler and the "
                             "boundary is on_step_end; pass the scheduler to callback.wrap()")
        self.directory = os.fspath(directory)
        self.wrap_options = wrap_options
        self.optimizer: lowdiff.LowDiffOptimizer | None = None
        self._state: dict[str, Any] | None = None     # TrainerState at the last boundary, as JSON data

    def wrap(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, *, scheduler: Any = None,
             extra_state: dict[str, Any] | None = None) -> lowdiff.LowDiffOptimizer:
        """``lowdiff.wrap`` for Trainer: give the result and ``scheduler`` to
        ``Trainer(optimizers=(opt, scheduler))``. The scheduler goes to ``extra_state`` (Trainer
        steps it, before ``on_step_end``), with Trainer's state."""
        extra = dict(extra_state or {})
        for name in ("scheduler", "trainer"):
            if name in extra:
                raise ValueError(f"extra_state[{name!r}] is the callback's own entry; use another name")
        if scheduler is not None:
            extra["scheduler"] = scheduler
        extra["trainer"] = self
        self.optimizer = lowdiff.wrap(optimizer, model, self.directory, extra_state=extra,
                                      **manual_boundary(self.wrap_options))
        return self.optimizer

    # -------------------------------------------------------------- Trainer hooks
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.optimizer is None:
            raise RuntimeError("LowDiffCallback: build the optimizer with callback.wrap() and pass it to "
                               "Trainer(optimizers=(opt, scheduler))")
        self._state = dataclasses.asdict(state)
        self.optimizer.boundary()

    def on_epoch_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        # The epoch's iterator draws its base seed from the global RNG after the last boundary;
        # Trainer's resume restores the RNG after making it, so that draw is exact.
        if self.optimizer is not None:
            self.optimizer.skip_between_steps_check()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.optimizer is not None:
            self.optimizer.flush()       # everything trained is durable when train() returns

    # -------------------------------------------------------------- extra_state protocol
    def state_dict(self) -> dict[str, Any]:
        return {"trainer_state": json.dumps(self._state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = json.loads(state_dict["trainer_state"])

    # -------------------------------------------------------------- resume
    def resume(self, trainer: Trainer) -> str | None:
        """Restore model, optimizer, scheduler, RNG and Trainer's state from the newest durable
        step; return the folder to pass as ``trainer.train(resume_from_checkpoint=...)`` (None when
        there is nothing to resume). The folder is written under ``args.output_dir``."""
        import recovery  # a leaf module: recovery imports lowdiff, not the other way round

        if self.optimizer is None:
            raise RuntimeError("LowDiffCallback.resume(): wrap the optimizer with callback.wrap() first")
        if trainer.optimizer is not self.optimizer:
            raise ValueError("the Trainer's optimizer is not the one callback.wrap() returned: pass it as "
                             "Trainer(optimizers=(opt, scheduler))")
        if trainer.model is None or trainer.args.output_dir is None:
            raise ValueError("LowDiffCallback.resume(): the Trainer needs a model and args.output_dir")
        step = recovery.resume(self.directory, trainer.model, self.optimizer)
        if step == 0 or self._state is None:
            return None
        folder = os.path.join(trainer.args.output_dir, RESUME_FOLDER)
        # Trainer reloads these weights: the bytes lowdiff just restored, so nothing changes.
        trainer.save_model(folder)
        TrainerState(**self._state).save_to_json(os.path.join(folder, "trainer_state.json"))
        torch.save(_rng_states(), os.path.join(folder, "rng_state.pth"))
        return folder


def _rng_states() -> dict[str, Any]:
    """The RNG states in the layout Trainer's ``_load_rng_state`` reads (taken now: just restored)."""
    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    return states
