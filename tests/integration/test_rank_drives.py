"""Rank directories on several local drives (docs/format.md, "Rank directories on several local
drives"), on real files without processes: where lowdiff.distributed.drives places a new rank
directory, how every reader finds it through rank-NNNNN/DRIVE.json (lowdiff.store.rankdirs), a drive
that is not mounted refused by name, a damaged DRIVE.json refused, never ignored. The 2-rank runs
(gloo) are tests/distributed/test_partitioned_drives.py."""
import json
import os

import pytest

from lowdiff.distributed.drives import place_rank_directory
from lowdiff.errors import CorruptCheckpointError, MissingDeviceError, VersionMismatchError
from lowdiff.store.rankdirs import (
    drive_of,
    is_partitioned,
    rank_directories,
    rank_directory,
    remove_drive_record,
)


def drives(tmp_path, count):
    root = tmp_path / "ckpt"
    return str(root), tuple([str(root)] + [str(tmp_path / f"nvme{k}" / "exp") for k in range(1, count)])


def test_local_ranks_go_to_drives_in_turn_and_readers_follow(tmp_path):
    root, disks = drives(tmp_path, 3)
    placed = [place_rank_directory(root, rank, disks, local_rank=rank) for rank in range(5)]
    # local rank l on drive l mod 3; drive 0 is the checkpoint directory itself (no DRIVE.json)
    assert placed == [os.path.join(root, "rank-00000"), os.path.join(disks[1], "rank-00001"),
                      os.path.join(disks[2], "rank-00002"), os.path.join(root, "rank-00003"),
                      os.path.join(disks[1], "rank-00004")]
    assert not os.path.exists(os.path.join(root, "rank-00000"))   # created by its store, as without drives
    assert sorted(os.listdir(os.path.join(root, "rank-00001"))) == ["DRIVE.json"]
    assert json.loads((tmp_path / "ckpt" / "rank-00001" / "DRIVE.json").read_text()) == \
        {"dir": placed[1], "version": 1}
    os.makedirs(placed[0])
    assert rank_directories(root) == {0: placed[0], 1: placed[1], 2: placed[2], 4: placed[4]}
    assert [rank_directory(root, r) for r in (1, 2, 4)] == [placed[1], placed[2], placed[4]]
    assert is_partitioned(root)


def test_a_rank_directory_that_exists_stays_where_it_is(tmp_path):
    root, disks = drives(tmp_path, 2)
    assert place_rank_directory(root, 1, disks, local_rank=1) == os.path.join(disks[1], "rank-00001")
    # A later run with other local ranks or drives: the DRIVE.json wins.
    assert place_rank_directory(root, 1, (root,), local_rank=0) == os.path.join(disks[1], "rank-00001")
    # A rank directory in the root that holds files stays in the root.
    os.makedirs(os.path.join(root, "rank-00003"))
    open(os.path.join(root, "rank-00003", "MANIFEST.json"), "w").close()
    assert place_rank_directory(root, 3, disks, local_rank=1) == os.path.join(root, "rank-00003")
    # One holding only a dead writer's temporary file is new: placed on its drive.
    os.makedirs(os.path.join(root, "rank-00005"))
    open(os.path.join(root, "rank-00005", ".DRIVE.json.tmp-999999-ab12"), "w").close()
    assert place_rank_directory(root, 5, disks, local_rank=1) == os.path.join(disks[1], "rank-00005")


def test_a_drive_not_mounted_is_refused_by_name_and_nothing_changes(tmp_path):
    root, disks = drives(tmp_path, 2)
    where = place_rank_directory(root, 1, disks, local_rank=1)
    os.rename(os.path.dirname(disks[1]), str(tmp_path / "unmounted"))
    for read in (lambda: rank_directory(root, 1), lambda: rank_directories(root),
                 lambda: place_rank_directory(root, 1, disks, local_rank=1)):
        with pytest.raises(MissingDeviceError, match="DRIVE.json") as raised:
            read()
        assert where in str(raised.value) and "not mounted" in str(raised.value)
    assert not os.path.exists(disks[1])   # not recreated
    assert os.listdir(os.path.join(root, "rank-00001")) == ["DRIVE.json"]


def test_a_directory_gone_from_a_drive_that_is_there_is_an_absent_rank(tmp_path):
    root, disks = drives(tmp_path, 2)
    where = place_rank_directory(root, 1, disks, local_rank=1)
    os.rmdir(where)   # (a dropped rank's, removed before its DRIVE.json)
    assert rank_directories(root) == {}
    assert drive_of(os.path.join(root, "rank-00001")) == where
    remove_drive_record(os.path.join(root, "rank-00001"))
    assert not os.path.exists(os.path.join(root, "rank-00001"))


@pytest.mark.parametrize("body, error, what", [
    ({"dir": "nvme1/rank-00001", "version": 1}, CorruptCheckpointError, "absolute"),
    ({"dir": "/mnt/nvme1/exp/rank-00002", "version": 1}, CorruptCheckpointError, "ending in rank-00001"),
    ({"dir": "/mnt/nvme1/exp/rank-00001"}, CorruptCheckpointError, "version"),
    ({"dir": "/mnt/nvme1/exp/rank-00001", "version": 2}, VersionMismatchError, "version 2"),
    ("not json", CorruptCheckpointError, "not valid JSON"),
], ids=["relative", "another-rank", "no-version", "newer-version", "not-json"])
def test_a_damaged_drive_record_is_refused_naming_it(tmp_path, body, error, what):
    home = tmp_path / "ckpt" / "rank-00001"
    home.mkdir(parents=True)
    (home / "DRIVE.json").write_text(body if isinstance(body, str) else json.dumps(body))
    with pytest.raises(error, match=what) as raised:
        rank_directory(str(tmp_path / "ckpt"), 1)
    assert str(home / "DRIVE.json") in str(raised.value)


def test_a_drive_record_beside_files_of_its_own_is_refused(tmp_path):
    root, disks = drives(tmp_path, 2)
    place_rank_directory(root, 1, disks, local_rank=1)
    open(os.path.join(root, "rank-00001", "MANIFEST.json"), "w").close()
    with pytest.raises(CorruptCheckpointError, match="one of the two places"):
        rank_directory(root, 1)


def test_more_drives_than_ranks_stripes_the_rank_directory_over_them(tmp_path):
    """A partitioned directory trained by one process given two drives (docs/format.md, "More drives
    than ranks"): its one rank directory stays in the checkpoint directory (local rank 0, drive 0),
    each full-checkpoint share is striped over it and ``nvme1/rank-00000`` (drive 1), differential
    shares go to the two in turn, and a resume reads them back."""
    import torch

    import lowdiff
    import recovery
    from lowdiff.store.manifest import read_manifest

    root, nvme1 = tmp_path / "ckpt", tmp_path / "nvme1" / "exp"
    (root / "rank-00000").mkdir(parents=True)   # a partitioned directory (as a run under torch.distributed left it)
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1), model, root, full_every=2, batch_steps=1,
                       options=lowdiff.Options(stripe_dirs=(str(nvme1),)))
    for _ in range(3):
        model(torch.randn(3, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
    opt.close()
    manifest = read_manifest(str(root / "rank-00000"))
    other = str(nvme1 / "rank-00000")
    assert manifest.fulls and all({s.dir for s in f.stripes} == {None, other} for f in manifest.fulls)
    assert {b.dir for b in manifest.batches} == {None, other}
    assert not (root / "rank-00000" / "DRIVE.json").exists()
    assert int(recovery.resume(root, model, torch.optim.SGD(model.parameters(), lr=0.1))) == 3
