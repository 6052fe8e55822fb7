"""lowdiff.store.rankdirs: where the ranks of a partitioned directory keep their shares — the
``rank-NNNNN/`` subdirectories of its root (docs/format.md, "Partitioned directories")."""
from __future__ import annotations

import os
import re

RANK_DIR_RE = re.compile(r"^rank-(\d{5})$")


def rank_directory(root, rank: int) -> str:
    """Where rank ``rank`` of a partitioned directory keeps its shares."""
    return os.path.join(os.fspath(root), f"rank-{rank:05d}")


def rank_directories(root) -> dict[int, str]:
    """{rank: path} of the ``rank-NNNNN/`` subdirectories of ``root``."""
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


def is_partitioned(root) -> bool:
    """Whether ``root`` is a partitioned directory (it has rank subdirectories)."""
    return bool(rank_directories(root))
