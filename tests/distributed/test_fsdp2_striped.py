"""FSDP2 (sharded state, each share holding its rank's chunks) with more drives than ranks (docs/format.md,
"More drives than ranks"): 2 ranks given 4 drives stripe each full-checkpoint share over their two
share drives; the job SIGKILLed after step 7 resumes exactly at 2 ranks, and a resume at 1 rank
gathers the uninterrupted run's state from every share's stripes."""
import os
import sys

from lowdiff.store.manifest import read_manifest

sys.path.insert(0, os.path.dirname(__file__))
from test_fsdp2_resume import (  # noqa: E402,F401 (dense_adamw: the module fixture, the reference run)
    assert_resumed_exactly,
    check_resharded,
    dense_adamw,
    launch,
    ok,
    resume_at,
)


def test_sharded_shares_striped_killed_and_resumed_at_2_and_1_ranks(tmp_path, dense_adamw):  # noqa: F811
    reference = dense_adamw[0]
    others = [tmp_path / f"nvme{k}" for k in (1, 2, 3)]
    drives = ("--stripe-dirs", ",".join(str(d) for d in others))
    crashed = launch(tmp_path / "run", tmp_path / "run", 2, "--crash-at", "7", *drives)
    assert [code for code, _ in crashed] == [-9, -9], crashed
    # Local rank 0 on drive 0 striped with drive 2, local rank 1 on drive 1 striped with drive 3.
    for home, other in ((tmp_path / "run" / "rank-00000", others[1] / "rank-00000"),
                        (others[0] / "rank-00001", others[2] / "rank-00001")):
        fulls = read_manifest(str(home)).fulls
        assert fulls and all({s.dir for s in f.stripes} == {None, str(other)} for f in fulls), fulls
    ok(launch(tmp_path / "run", tmp_path / "res", 2, *drives))
    assert_resumed_exactly(tmp_path, reference, "res", lowest=4)
    check_resharded(reference[2], resume_at(tmp_path, tmp_path / "run", 1))
