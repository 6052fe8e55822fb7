"""lowdiff.train: what the training code holds — ``wrap()`` and the optimizer facade, its validated
settings, the process lifecycle (flush at exit and on SIGTERM), and the data loader that survives a
resume."""
