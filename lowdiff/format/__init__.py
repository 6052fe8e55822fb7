"""lowdiff.format: every byte lowdiff writes and reads — the schema, the file container, step records,
differential batches, full checkpoints and their shares (docs/format.md). Imports only fastio and
lowdiff.errors/faults."""
