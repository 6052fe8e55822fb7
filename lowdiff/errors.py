"""lowdiff's own exception types. I/O failures stay OSError; misuse is ValueError/TypeError."""


class CheckpointError(Exception):
    """Base class of lowdiff's checkpoint errors."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, fails a checksum or has an impossible layout. The message names the
    file and what is wrong."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class ForeignFileError(CorruptCheckpointError):
    """The file is not a lowdiff file (wrong magic bytes)."""


class VersionMismatchError(CorruptCheckpointError):
    """The file was written by a format version this lowdiff cannot read."""


class CheckpointLockedError(CheckpointError):
    """Another live trainer holds the directory's lock."""


class NoCheckpointError(CheckpointError):
    """Nothing that verifies was found where a checkpoint was required."""
