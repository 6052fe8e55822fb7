"""The nonzero elements of a gradient, judged by bits: what a sparse record of it must hold.

Under DDP the gradient the optimizer consumes is the comm hook's aggregate, and the differential
records its nonzero elements. A value test (``tensor.nonzero()``) would drop -0.0, which the
replay would then give back as +0.0; testing the bits keeps every element whose bytes differ from
a zero fill, so the replayed gradient has the same bytes. On CPU one pass of lowdiff.distributed._nonzero
(branch-free with AVX2 for 4-byte elements, else blocks of zeros skipped 32 bytes at a time;
no GIL) replaces torch's count, fill and gather: it
runs on the training thread every step, where torch's three passes cost several times more.
"""
from __future__ import annotations

import torch

from lowdiff.distributed._nonzero import nonzero_into

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def nonzero_elements(flat: torch.Tensor, expected: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(indices as int32, values) of the elements of the 1-D tensor ``flat`` whose bits are not all
    zero, in ascending order. ``expected``: about how many there will be (e.g. the last step's
    count); a good guess makes one pass enough, a short one costs a second pass."""
    size = flat.element_size()
    if flat.device.type != "cpu" or not flat.is_contiguous() or size not in _BITS or flat.numel() >= 2**31:
        return _nonzero_torch(flat)
    count = flat.numel()
    capacity = min(count, max(expected + expected // 4, 1024))
    while True:
        indices = torch.empty(capacity, dtype=torch.int32)
        values = torch.empty(capacity, dtype=flat.dtype)
        found = nonzero_into(flat.data_ptr(), count, size, indices.data_ptr(), values.data_ptr(), capacity)
        if found <= capacity:
            return indices[:found], values[:found]
        capacity = found   # the exact count is known now: the second pass fits


def _nonzero_torch(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same with torch operations (other devices, unusual dtypes or sizes)."""
    bits = flat.view(_BITS[flat.element_size()]) if flat.element_size() in _BITS and flat.is_contiguous() else flat
    indices = bits.nonzero().view(-1)
    return indices.to(torch.int32 if flat.numel() < 2**31 else torch.int64), flat.index_select(0, indices)
