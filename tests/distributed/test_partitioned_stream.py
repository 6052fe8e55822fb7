"""A partitioned chain is replayed holding the files of the records in flight, not the whole chain:
each share file is fetched when the replay reaches it and let go once its records are applied.
Resumed with one process (no process group: the same code fetches every share itself)."""
import os
import sys
import weakref

import torch

import recovery
from recovery.partitioned import restore as distributed

sys.path.insert(0, os.path.dirname(__file__))
import partition_worker  # noqa: E402
from partition_runs import digests, launch, ok  # noqa: E402

STEPS = 30


def test_a_long_partitioned_chain_is_replayed_with_bounded_memory(tmp_path, monkeypatch):
    directory = tmp_path / "ckpt"
    # One full checkpoint (step 0), then a differential file per step and share: 2 x 30 files.
    ok(launch(directory, tmp_path / "run", 2, "--full-every", "1000", "--batch-steps", "1", steps=STEPS))
    reference = digests(tmp_path / "run-0.txt")[1]
    files = sum(1 for rank in ("rank-00000", "rank-00001") for name in os.listdir(directory / rank)
                if name.startswith("diff-"))
    assert files == 2 * STEPS

    live: list = []
    most = [0]
    read_whole = distributed._read_whole

    def counted(path):
        data = read_whole(path)
        live.append(weakref.ref(data))
        most[0] = max(most[0], sum(ref() is not None for ref in live))
        return data

    monkeypatch.setattr(distributed, "_read_whole", counted)
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start = recovery.resume(directory, model, opt)
    assert int(start) == STEPS and start.full_step == 0
    assert partition_worker.shared_digest(model, opt) == reference[STEPS][1]
    assert len(live) == files
    # Per share: the records in flight, the file being fetched and the last record applied.
    bound = 2 * (distributed.REPLAY_WINDOW + 2)
    assert most[0] <= bound < files, f"{most[0]} share files in memory at once, of {files}"
