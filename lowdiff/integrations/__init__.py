"""Integrations with training frameworks (optional dependencies, imported only from these modules):
``lowdiff.integrations.hf`` (Hugging Face Trainer), ``lowdiff.integrations.lightning`` (PyTorch
Lightning)."""
