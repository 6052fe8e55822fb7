"""Applying one recorded step to parameters and an optimizer: the replay half of exactness.

Recovery replays records with it, and a replica that follows training (LowDiff+) applies captured
steps with it; both need exactly what training did: the recorded hyper-parameters, the recorded
gradient decompressed into ``p.grad``, one optimizer step, then the hyper-parameters after the
scheduler stepped.
"""
from __future__ import annotations

import torch

from . import capture
from .compress import decompress_into
from .errors import CorruptCheckpointError


def apply_record(record, params: list, optimizer, *, path: str = "<record>") -> None:
    """Redo step ``record.step`` on ``params`` (in param_groups order) through ``optimizer``. A
    step GradScaler skipped changes only the hyper-parameters, as it did in training."""
    objects = record.objects
    if not record.skipped:
        if len(record.grads) != len(params):
            raise CorruptCheckpointError(path, f"step {record.step} has {len(record.grads)} gradients, "
                                               f"the optimizer has {len(params)} parameters")
        capture.apply_hyperparameters(optimizer.param_groups, objects["groups_used"])
        with torch.no_grad():
            for p, grad in zip(params, record.grads):
                if grad.kind == "none":
                    p.grad = None
                    continue
                if p.grad is None:
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                decompress_into(grad, p.grad)
        optimizer.step()
    capture.apply_hyperparameters(optimizer.param_groups, objects["groups_after"])
