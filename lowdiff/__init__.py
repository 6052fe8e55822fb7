"""lowdiff: per-iteration checkpointing for PyTorch with exact resume."""
from .compress import Dense, TopK
from .errors import (CheckpointError, CheckpointLockedError, CorruptCheckpointError, ForeignFileError,
                     NoCheckpointError, VersionMismatchError)
from .wrapper import LowDiffOptimizer, wrap

__all__ = ["CheckpointError", "CheckpointLockedError", "CorruptCheckpointError", "Dense", "ForeignFileError",
           "LowDiffOptimizer", "NoCheckpointError", "TopK", "VersionMismatchError", "wrap"]
