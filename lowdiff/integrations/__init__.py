"""Integrations with training frameworks (optional dependencies, imported only from these modules):
``lowdiff.integrations.hf`` (Hugging Face Trainer), ``lowdiff.integrations.lightning`` (PyTorch
Lightning), ``lowdiff.integrations.torchtitan`` (torchtitan's Trainer)."""
from __future__ import annotations

import dataclasses
from typing import Any


def manual_boundary(wrap_options: dict) -> dict[str, Any]:
    """``wrap_options`` with the iteration boundary set to "manual" (the callback marks it), keeping
    the other fields of an ``options=lowdiff.Options(...)`` given."""
    import lowdiff

    options = wrap_options.get("options") or lowdiff.Options()
    return {**wrap_options, "options": dataclasses.replace(options, boundary="manual")}


def refuse_fixed_options(wrap_options: dict, fixed: tuple, why: str) -> None:
    """A callback sets the ``wrap()`` options in ``fixed`` itself; passing one is a TypeError."""
    for name in fixed:
        if name in wrap_options:
            raise TypeError(f"LowDiffCallback sets {name}= itself: {why}")
