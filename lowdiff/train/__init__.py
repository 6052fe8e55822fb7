"""lowdiff.train: what the training code holds — ``wrap()`` and the optimizer facade, its option
objects and validated settings, the process lifecycle (flush at exit and on SIGTERM), and the data
loader that survives a resume."""
