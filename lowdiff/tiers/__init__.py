"""lowdiff.tiers: storage tiers — a fast local directory staged to a shared one (a directory, or an
``s3://bucket/prefix`` in an object store) by a background drainer, each tier with its own retention
policy (docs/format.md, "Storage tiers")."""
from lowdiff.store.retention import KeepAll, KeepEvery, KeepLast
from lowdiff.tiers.objectstore import ObjectStore
from lowdiff.tiers.policy import Tiers

__all__ = ["KeepAll", "KeepEvery", "KeepLast", "ObjectStore", "Tiers"]
