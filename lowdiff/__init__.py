"""lowdiff: per-iteration checkpointing for PyTorch with exact resume."""
from .compress import Dense, TopK
from .data import ResumableLoader
from .ddp import init_process_group
from .errors import (
                     CheckpointError,
                     CheckpointFileError,
                     CheckpointLockedError,
                     CorruptCheckpointError,
                     DirectoryBusyError,
                     ForeignFileError,
                     IncompatibleCheckpointError,
                     NoCheckpointError,
                     VersionMismatchError,
)
from .wrapper import LowDiffOptimizer, wrap

__all__ = ["CheckpointError", "CheckpointFileError", "CheckpointLockedError", "CorruptCheckpointError", "Dense",
           "DirectoryBusyError", "ForeignFileError", "IncompatibleCheckpointError", "LowDiffOptimizer",
           "NoCheckpointError", "ResumableLoader", "TopK", "VersionMismatchError", "init_process_group", "wrap"]
