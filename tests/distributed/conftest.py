"""The uninterrupted 2-rank run the partitioned-directory tests compare against (run once)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from partition_runs import digests, launch, ok  # noqa: E402


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """An uninterrupted 2-rank TopK run to partition_runs.STEPS (full_every 6, batch_steps 3): its
    digests per rank ([{step: (full, shared)}]) and its directory. Tests copy it before changing it."""
    base = tmp_path_factory.mktemp("reference")
    ok(launch(base / "ckpt", base / "ref", 2))
    return [digests(base / f"ref-{rank}.txt")[1] for rank in range(2)], base / "ckpt"
