"""lowdiff.persist: the background side of a run — writers of differential batches and full
checkpoints, the session that schedules and makes them durable, and replica mode's worker."""
