"""lowdiff.control: the controller that picks the full-checkpoint interval, the batch size and whether
to record differentials, from measured costs (its cost model and its measurements kept on disk)."""
