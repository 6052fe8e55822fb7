"""recovery.partitioned: resuming and verifying a partitioned directory (each rank's share of every
checkpoint in its rank directory; docs/format.md, "Partitioned directories")."""
