"""Gradient compressors. A compressor turns a gradient into what the optimizer will consume and
what is recorded: both are the same tensor, so replay is exact."""
from __future__ import annotations

import dataclasses

import torch

from lowdiff.format.records import Compressed


@dataclasses.dataclass(frozen=True)
class Dense:
    """Record gradients exactly as they are (largest records, no approximation)."""

    name = "dense"

    def compress(self, grad: torch.Tensor, residual_slot: int, residuals: dict[int, torch.Tensor]) -> Compressed:
        flat = grad.detach().reshape(-1)
        return Compressed("dense", flat.numel(), flat.clone())

    def stores_whole(self, numel: int) -> bool:
        """Whether ``compress`` of a gradient of ``numel`` elements is a plain copy of it."""
        return True

    @property
    def error_feedback(self) -> bool:
        return False


@dataclasses.dataclass(frozen=True)
class TopK:
    """Keep the ``ratio`` largest-magnitude entries of each gradient tensor.

    With ``error_feedback`` the dropped mass is carried to the next step in a per-rank residual.
    Tensors with fewer than ``min_numel`` elements are stored dense: their indices would cost more
    than they save.
    """

    ratio: float = 0.01
    error_feedback: bool = False
    min_numel: int = 4096
    name = "topk"

    def __post_init__(self) -> None:
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"TopK.ratio={self.ratio} must be in (0, 1]")
        if self.min_numel < 1:
            raise ValueError(f"TopK.min_numel={self.min_numel} must be >= 1")

    def stores_whole(self, numel: int) -> bool:
        """Whether ``compress`` of a gradient of ``numel`` elements is a plain copy of it."""
        return numel < self.min_numel and not self.error_feedback

    def compress(self, grad: torch.Tensor, residual_slot: int, residuals: dict[int, torch.Tensor]) -> Compressed:
        flat = grad.detach().reshape(-1)
        numel = flat.numel()
        if self.error_feedback:
            residual = residuals.get(residual_slot)
            if residual is not None:
                flat = flat + residual
        if numel < self.min_numel:
            if self.error_feedback:
                residuals.pop(residual_slot, None)
            return Compressed("dense", numel, flat.clone())
        k = max(1, int(numel * self.ratio))
        # Unsorted: the record encoder sorts (indices, values) in the background; the training
        # thread pays only for the selection, as a compressor without checkpoints would.
        picked = torch.topk(flat.abs(), k, sorted=False).indices
        values = flat.index_select(0, picked)
        if self.error_feedback:
            residual = flat.clone() if flat.data_ptr() == grad.data_ptr() else flat
            residual.index_fill_(0, picked, 0)
            residuals[residual_slot] = residual
        return Compressed("sparse", numel, values, picked, sorted=False)


def compress_all(compressor, grads: list, residuals: dict) -> list:
    """``compressor.compress(grad, slot, residuals)`` of each gradient, ``slot`` its position in
    ``grads`` (None: no gradient; None out). The gradients the compressor stores whole (its
    ``stores_whole``, where it has one) are copied by one concatenation per device and dtype
    instead of one clone each, and recorded as views of that copy: the same values, so the same
    bytes. On a GPU each clone is a kernel launch from the training thread (a 350M GPT has ~150
    tensors below TopK's ``min_numel``), and a record whose values lie back to back is written
    without being joined again (lowdiff.format.records)."""
    stores_whole = getattr(compressor, "stores_whole", None)
    out: list = []
    whole: dict = {}   # (device, dtype) -> [(slot, flat gradient)]
    for slot, grad in enumerate(grads):
        if grad is not None and stores_whole is not None and stores_whole(grad.numel()):
            flat = grad.detach().reshape(-1)
            whole.setdefault((flat.device, flat.dtype), []).append((slot, flat))
            out.append(None)
        else:
            out.append(None if grad is None else compressor.compress(grad, slot, residuals))
    for items in whole.values():
        flats = [flat for _, flat in items]
        copies = torch.cat(flats).split([f.numel() for f in flats]) if len(flats) > 1 else [flats[0].clone()]
        for (slot, flat), copy in zip(items, copies):
            out[slot] = Compressed("dense", flat.numel(), copy)
    return out


def decompress_into(record: Compressed, out: torch.Tensor) -> torch.Tensor:
    """Write the gradient ``record`` stands for into ``out`` (flat view of a gradient tensor)."""
    flat = out.view(-1)
    # Dense and sparse records always carry values, sparse ones indices too (see Compressed).
    if record.kind == "dense":
        assert record.values is not None
        flat.copy_(record.values)
    else:
        flat.zero_()
        assert record.indices is not None and record.values is not None
        # Indices are unique: a plain scatter, deterministic, no atomics. Records read from disk
        # live on the CPU; a CUDA gradient needs them on its device.
        indices, values = record.indices, record.values
        if indices.dtype != torch.int64 or indices.device != flat.device:   # a call saved per tensor when not
            indices = indices.to(device=flat.device, dtype=torch.int64)
        if values.device != flat.device:
            values = values.to(flat.device)
        flat.index_copy_(0, indices, values)
    return out
