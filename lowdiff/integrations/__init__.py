"""Integrations with training frameworks (optional dependencies, imported only from these modules):
``lowdiff.integrations.hf`` (Hugging Face Trainer), ``lowdiff.integrations.lightning`` (PyTorch
Lightning)."""


def refuse_fixed_options(wrap_options: dict, fixed: tuple, why: str) -> None:
    """A callback sets the ``wrap()`` options in ``fixed`` itself; passing one is a TypeError."""
    for name in fixed:
        if name in wrap_options:
            raise TypeError(f"LowDiffCallback sets {name}= itself: {why}")
