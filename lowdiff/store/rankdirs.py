"""lowdiff.store.rankdirs: where the ranks of a partitioned directory keep their shares — the
``rank-NNNNN/`` subdirectories of its root (docs/format.md, "Partitioned directories"), or, for a
rank placed on another local drive, the directory its ``rank-NNNNN/DRIVE.json`` names (docs/format.md,
"Rank directories on several local drives"). Every reader and trainer takes a rank's directory from
here, so a rank directory on a drive is found wherever one under the root would be.
"""
from __future__ import annotations

import os
import re

from lowdiff.errors import CorruptCheckpointError, MissingDeviceError
from lowdiff.format.container import DriveRecord, read_file

RANK_DIR_RE = re.compile(r"^rank-(\d{5})$")
DRIVE_NAME = "DRIVE.json"
_OWN_FILES = ("MANIFEST.json",)   # (and full-*/diff-* files): what a rank directory holds itself


def home_directory(root, rank: int) -> str:
    """``root/rank-NNNNN``: rank ``rank``'s directory, or its pointer to another drive."""
    return os.path.join(os.fspath(root), f"rank-{rank:05d}")


def drive_of(home: str) -> str | None:
    """The directory ``home/DRIVE.json`` names (None: ``home`` has no DRIVE.json, it is the rank's
    directory itself). Raises MissingDeviceError when neither that directory nor the drive's
    directory holding it exists (a drive not mounted: never read as an absent rank), and
    CorruptCheckpointError (or VersionMismatchError) when DRIVE.json is not a valid record for this
    rank, or ``home`` also holds files of its own (one rank, one place)."""
    path = os.path.join(home, DRIVE_NAME)
    data = read_file(path)
    if data is None:
        return None
    record = DriveRecord.from_json(data, path, os.path.basename(os.path.normpath(home)))
    own = sorted(n for n in os.listdir(home) if n in _OWN_FILES or n.startswith(("full-", "diff-")))
    if own:
        raise CorruptCheckpointError(path, f"names {record.dir} as this rank's directory, but {home} holds "
                                           f"{', '.join(own[:3])} itself: one of the two places is not this "
                                           f"run's (move the other away)")
    if not os.path.isdir(record.dir) and not os.path.isdir(os.path.dirname(record.dir)):
        raise MissingDeviceError(f"{path}: the rank's directory is {record.dir}, on a drive whose directory "
                                 f"{os.path.dirname(record.dir)} does not exist (a drive that is not mounted?); "
                                 f"mount it and start again")
    return record.dir


def rank_directory(root, rank: int) -> str:
    """Where rank ``rank`` of a partitioned directory keeps its shares: ``root/rank-NNNNN``, or the
    directory on another drive its DRIVE.json names (see ``drive_of`` for what it raises)."""
    home = home_directory(root, rank)
    return drive_of(home) or home


def rank_homes(root) -> dict[int, str]:
    """{rank: ``root/rank-NNNNN``} of the rank subdirectories of ``root``, as they are named (no
    DRIVE.json followed)."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for name in names:
        m = RANK_DIR_RE.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            out[int(m.group(1))] = os.path.join(root, name)
    return out


def rank_directories(root) -> dict[int, str]:
    """{rank: path} of the rank directories of ``root``, each where it is (``rank_directory``). A
    DRIVE.json naming a directory that is gone from a drive that is there (a dropped rank's,
    removed: ``remove_drive_record``) is an absent rank directory, left out."""
    out = {}
    for rank, home in rank_homes(root).items():
        where = drive_of(home)
        if where is None or os.path.isdir(where):
            out[rank] = where or home
    return out


def is_partitioned(root) -> bool:
    """Whether ``root`` is a partitioned directory (it has rank subdirectories)."""
    return bool(rank_homes(root))


def remove_drive_record(home: str) -> None:
    """Remove ``home``'s DRIVE.json, then ``home`` itself when that leaves it empty (``rmdir``):
    called once the directory it names is removed (docs/format.md, "Dropped ranks")."""
    try:
        os.unlink(os.path.join(home, DRIVE_NAME))
    except FileNotFoundError:
        pass
    try:
        os.rmdir(home)
    except FileNotFoundError:
        pass
    except OSError:   # (ENOTEMPTY: files that are not ours are never deleted)
        pass
