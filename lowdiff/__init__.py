"""lowdiff: per-iteration checkpointing for PyTorch with exact resume."""
from lowdiff.distributed.ddp import init_process_group
from lowdiff.errors import (
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
from lowdiff.step.compress import Dense, TopK
from lowdiff.train.data import ResumableLoader
from lowdiff.train.wrapper import LowDiffOptimizer, wrap

__all__ = ["CheckpointError", "CheckpointFileError", "CheckpointLockedError", "CorruptCheckpointError", "Dense",
           "DirectoryBusyError", "ForeignFileError", "IncompatibleCheckpointError", "LowDiffOptimizer",
           "NoCheckpointError", "ResumableLoader", "TopK", "VersionMismatchError", "init_process_group", "wrap"]
