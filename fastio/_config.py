"""fastio configuration: one frozen dataclass, and the one place environment variables are read."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

BACKEND_CHOICES = ("auto", "uring", "pwrite")
ALIGN_BYTES = 4096


@dataclasses.dataclass(frozen=True)
class FastioConfig:
    """Tuning of writers, readers and the shared engine.

    backend: "auto" probes io_uring once and falls back to "pwrite"; explicit choices are obeyed.
    direct: open files with O_DIRECT where the filesystem allows it (falls back per file).
    chunk_bytes: the engine splits requests into pieces of this size so several are in flight.
    queue_depth: io_uring submission queue entries (pieces in flight).
    threads: worker threads of the pwrite backend.
    staging_slots / staging_slot_bytes: ring of aligned staging buffers a Writer copies small or
        unaligned data into; copy-in of slot i+1 overlaps the write of slot i.
    """

    backend: str = "auto"
    direct: bool = True
    chunk_bytes: int = 4 << 20
    queue_depth: int = 32
    threads: int = 4
    staging_slots: int = 8
    staging_slot_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"FastioConfig.backend={self.backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
        for name in ("chunk_bytes", "staging_slot_bytes"):
            value = getattr(self, name)
            if value <= 0 or value % ALIGN_BYTES:
                raise ValueError(f"FastioConfig.{name}={value} must be a positive multiple of {ALIGN_BYTES}")
        for name in ("queue_depth", "threads", "staging_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"FastioConfig.{name}={getattr(self, name)} must be >= 1")

    @classmethod
    def from_env(cls, **overrides: Any) -> FastioConfig:
        """Defaults, then FASTIO_* environment variables, then explicit arguments (which win)."""
        values: dict[str, Any] = {}
        env_backend = os.environ.get("FASTIO_BACKEND")
        if env_backend:
            if env_backend not in BACKEND_CHOICES:
                raise ValueError(
                    f"FASTIO_BACKEND={env_backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
            values["backend"] = env_backend
        env_direct = os.environ.get("FASTIO_DIRECT")
        if env_direct:
            values["direct"] = env_direct not in ("0", "false", "no")
        values.update(overrides)
        return cls(**values)
