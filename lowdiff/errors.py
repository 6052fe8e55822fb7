"""lowdiff's own exception types. I/O failures stay OSError; misuse is ValueError/TypeError."""


class CheckpointError(Exception):
    """Base class of lowdiff's checkpoint errors."""


class CheckpointFileError(CheckpointError):
    """Something is wrong with one file; the message names the file and what is wrong."""

    def __init__(self, path: str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


class CorruptCheckpointError(CheckpointFileError):
    """A file is truncated, fails a checksum, has an impossible layout or is not what the manifest
    says it is. Resume skips it and falls back to the newest state that verifies."""


class ForeignFileError(CorruptCheckpointError):
    """The file is not a lowdiff file (wrong magic bytes), or not one of this directory's run."""


class VersionMismatchError(CheckpointFileError):
    """The file was written by a format version this lowdiff cannot read. Not damage: it is never
    skipped silently and never deleted (a newer lowdiff may have written it)."""


class IncompatibleCheckpointError(CheckpointError):
    """The checkpoint does not fit the objects it is loaded into (another optimizer class, other
    parameters or shapes, another compressor kind). Raised before anything is changed."""


class CheckpointLockedError(CheckpointError):
    """Another live trainer holds the directory's lock."""


class NoCheckpointError(CheckpointError):
    """Nothing that verifies was found where a checkpoint was required."""


class DirectoryBusyError(CheckpointError):
    """A reader could not see one consistent committed state: a live trainer kept replacing the
    manifest while it read. Retrying later (or stopping the trainer) helps."""


class MissingRankDirectoryError(CheckpointError):
    """A partitioned directory lacks a rank directory that its full checkpoints need. Never read as
    empty and never a reason to delete: the message names the directory and what to do."""


class MissingDeviceError(CheckpointError):
    """A striped full checkpoint, a differential batch on another drive, or a rank directory on
    another drive (rank-NNNNN/DRIVE.json) names a device directory that does not exist (a drive
    not mounted). Never read as empty and never a reason
    to delete: the message names the directory."""
