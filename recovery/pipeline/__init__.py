"""recovery.pipeline: the replay pipeline — records read, verified and decoded ahead by worker threads
and applied in order, the freed memory kept for reuse while it runs, and its progress."""
