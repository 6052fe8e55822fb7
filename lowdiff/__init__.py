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
    MissingDeviceError,
    MissingRankDirectoryError,
    NoCheckpointError,
    VersionMismatchError,
)
from lowdiff.step.compress import Dense, TopK
from lowdiff.store.retention import KeepAll, KeepEvery, KeepLast
from lowdiff.tiers.policy import Tiers
from lowdiff.train.data import ResumableLoader
from lowdiff.train.options import Auto, Fixed, Options, Replica
from lowdiff.train.wrapper import LowDiffOptimizer, wrap

__all__ = ["Auto", "CheckpointError", "CheckpointFileError", "CheckpointLockedError", "CorruptCheckpointError",
           "Dense", "DirectoryBusyError", "Fixed", "ForeignFileError", "IncompatibleCheckpointError",
           "KeepAll", "KeepEvery", "KeepLast", "LowDiffOptimizer", "MissingDeviceError",
           "MissingRankDirectoryError",
           "NoCheckpointError", "Options", "Replica", "ResumableLoader", "Tiers", "TopK",
           "VersionMismatchError", "init_process_group", "wrap"]
