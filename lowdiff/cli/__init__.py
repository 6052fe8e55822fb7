"""lowdiff.cli: ``python -m lowdiff`` — demo, inspect, verify, export, tune. The only part of lowdiff
(with integrations) that may import recovery, and only inside functions."""
