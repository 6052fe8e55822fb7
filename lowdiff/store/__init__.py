"""lowdiff.store: one checkpoint directory — its manifest, the reconciled view of its files, the lock
and commits of a live trainer, and the retention rule that decides what may be deleted."""
