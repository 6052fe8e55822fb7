"""lowdiff.distributed: data-parallel training — the DDP comm hook and what it records, and the
partitioned directory layout (each rank its share of a checkpoint, complete sets, dropped ranks)."""
