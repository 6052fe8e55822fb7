"""WrapConfig: the validated settings of one lowdiff.wrap call."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class WrapConfig:
    """full_every / batch_steps: an int, or "auto" to let the controller choose from measured costs.
    max_pending_batches: how many batches may be recorded but not yet durable before step() blocks;
    a SIGKILL loses at most about that many batches of steps."""

    full_every: int | str = 100
    batch_steps: int | str = 10
    keep_full: int = 2
    max_pending_batches: int = 2
    overwrite: bool = False
    failure_rate_per_hour: float = 0.1

    def __post_init__(self):
        for name in ("full_every", "batch_steps"):
            value = getattr(self, name)
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive int or 'auto'")
        if self.keep_full < 1:
            raise ValueError(f"keep_full={self.keep_full!r} must be >= 1")
        if self.max_pending_batches < 1:
            raise ValueError(f"max_pending_batches={self.max_pending_batches!r} must be >= 1")
        if not self.failure_rate_per_hour > 0:
            raise ValueError(f"failure_rate_per_hour={self.failure_rate_per_hour!r} must be > 0")
