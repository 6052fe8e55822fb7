"""A node with more drives than ranks (docs/format.md, "More drives than ranks"): 2 gloo ranks given
4 drives (temporary directories) stripe each full-checkpoint share over their share drives (local
rank l: drives l and l + 2) and send their differential shares to them in turn. The job SIGKILLed
while writing, then resumed with 2 ranks and with 1, lands on the uninterrupted run's state byte
for byte; a stripe deleted or truncated makes its set damaged (resume falls back, warning with the
stripe file's name); a drive missing at resume is refused by name on every rank without a hang;
the placement follows torchrun's LOCAL_RANK when every rank has it."""
import os
import sys

from lowdiff.cli.main import main as cli
from lowdiff.format.sharefile import read_share_index
from lowdiff.store.manifest import read_manifest

sys.path.insert(0, os.path.dirname(__file__))
import partition_worker  # noqa: E402
from partition_runs import STEPS, digests, launch, ok, resumed_exactly  # noqa: E402


def drives_of(tmp_path):
    """The checkpoint directory (drive 0) and the other three drives' directories."""
    return tmp_path / "ckpt", [tmp_path / f"nvme{k}" / "exp" for k in (1, 2, 3)]


def stripe_arg(others):
    return ("--stripe-dirs", ",".join(str(d) for d in others))


def striped_fulls(directory):
    """{step: FullEntry} of the striped full shares a rank directory lists."""
    return {f.step: f for f in read_manifest(str(directory)).fulls if f.stripes}


def test_shares_striped_over_share_drives_killed_then_resumed_with_2_and_1_ranks(tmp_path, reference, capsys):
    ref, _ = reference
    ckpt, (d1, d2, d3) = drives_of(tmp_path)
    drives = stripe_arg((d1, d2, d3))
    crashed = launch(ckpt, tmp_path / "run", 2, *drives, "--crash-at", "10", "--crash-ranks", "1")
    assert crashed[1][0] == -9
    # Local rank 0: its rank directory on drive 0, stripes on drive 2; local rank 1: drive 1 and 3.
    rank0, rank1 = ckpt / "rank-00000", d1 / "rank-00001"
    for home, other in ((rank0, d2 / "rank-00000"), (rank1, d3 / "rank-00001")):
        fulls = striped_fulls(home)
        assert 0 in fulls, f"{home}: the base share is not striped"
        assert {s.dir for s in fulls[0].stripes} == {None, str(other)}
        assert any(n.endswith(".lds") for n in os.listdir(other))
        index = read_share_index(str(home / fulls[0].file))
        assert index.stripes == fulls[0].stripes and os.path.getsize(home / fulls[0].file) < index.body_bytes
        # Differential shares go to the rank's share drives in turn.
        assert any(n.startswith("diff-") for n in os.listdir(other)) and \
            any(n.startswith("diff-") for n in os.listdir(home))
    assert not (d1 / "rank-00000").exists() and not (d2 / "rank-00001").exists()

    ok(launch(ckpt, tmp_path / "resumed", 2, *drives))
    resumed_exactly(tmp_path / "resumed", ref)
    # Retention removed the retired sets' stripes with them: a stripe left on a drive is listed, or
    # belongs to a share file still in the rank directory (one the crash left unlisted, kept as any
    # file the manifest does not explain).
    for directory, other in ((rank0, d2 / "rank-00000"), (rank1, d3 / "rank-00001")):
        assert 0 not in striped_fulls(directory)
        listed = {s.file for f in read_manifest(str(directory)).fulls for s in f.stripes}
        for name in (n for n in os.listdir(other) if n.endswith(".lds")):
            assert name in listed or (directory / (name[:-len("-s01.lds")] + ".ldf")).exists(), name
    assert cli(["verify", str(ckpt)]) == 0
    assert "0 do not" in capsys.readouterr().out
    assert cli(["inspect", str(ckpt)]) == 0
    assert f"rank-00001: on {rank1}" in capsys.readouterr().out
    assert cli(["export", str(ckpt), "-o", str(tmp_path / "out.pt")]) == 0
    assert partition_worker.exported_step_and_digest(tmp_path / "out.pt") == (STEPS, ref[0][STEPS][1])
    # A 1-rank resume that is not given the drives reads every share from its stripes (resharded).
    ok(launch(ckpt, tmp_path / "plain", 1, "--resume-only"))
    assert digests(tmp_path / "plain-0.txt")[1][STEPS] == ref[0][STEPS]

    # One rank, the same drives: the shares of both ranks are read from their stripes (resharded),
    # and rank 0 retires the dropped rank's files and removes its directories from drives 1 and 3.
    ok(launch(ckpt, tmp_path / "one", 1, *drives, steps=32))
    step, got = digests(tmp_path / "one-0.txt")
    assert step == STEPS and got[STEPS] == ref[0][STEPS]
    assert not rank1.exists() and not (d3 / "rank-00001").exists() and not (ckpt / "rank-00001").exists()
    assert cli(["verify", str(ckpt)]) == 0


def test_a_damaged_stripe_falls_back_and_a_missing_drive_is_refused_on_every_rank(tmp_path, reference, caplog,
                                                                                  capsys):
    ref, _ = reference
    ckpt, (d1, d2, d3) = drives_of(tmp_path)
    drives = stripe_arg((d1, d2, d3))
    ok(launch(ckpt, tmp_path / "run", 2, *drives, "--full-every", "4", steps=8))
    newest = max(striped_fulls(d1 / "rank-00001"))
    assert newest == 8
    stripe = next(s for s in striped_fulls(d1 / "rank-00001")[newest].stripes if s.dir is not None)
    path = os.path.join(stripe.dir, stripe.file)
    # A truncated stripe: the set of step 8 is damaged; resume falls back to step 4's set and replays.
    with open(path, "r+b") as f:
        f.truncate(stripe.nbytes - 4096)
    for code, err in launch(ckpt, tmp_path / "trunc", 2, "--resume-only"):
        assert code == 0, err
        assert stripe.file in err, err       # the warning names the stripe file
    for rank in range(2):
        start, got = digests(tmp_path / f"trunc-{rank}.txt")
        assert start == 8 and got[8] == ref[rank][8]
    assert cli(["verify", str(ckpt)]) != 0
    share = striped_fulls(d1 / "rank-00001")[newest].file
    assert f"CORRUPT  {d1 / 'rank-00001' / share}: stripe 1 of" in capsys.readouterr().out
    os.unlink(path)   # deleted: the same
    for code, err in launch(ckpt, tmp_path / "gone", 2, "--resume-only"):
        assert code == 0 and stripe.file in err, err

    # A drive not mounted: refused by name on both ranks, through wrap and through a plain resume.
    kept = sorted(os.listdir(d2 / "rank-00000"))
    os.rename(tmp_path / "nvme2", tmp_path / "unmounted")
    for extra in (drives, ("--travel", "4")):
        for code, err in launch(ckpt, tmp_path / "again", 2, *extra, timeout=120):
            assert code not in (0, -9), err     # failed by itself on every rank, not killed at the deadline
            assert "MissingDeviceError" in err and str(d2 / "rank-00000") in err, err
    assert not (tmp_path / "nvme2").exists()                    # not recreated
    os.rename(tmp_path / "unmounted", tmp_path / "nvme2")
    assert sorted(os.listdir(d2 / "rank-00000")) == kept        # nothing was deleted


def test_local_rank_from_torchrun_environment_places_the_ranks(tmp_path):
    """Every rank has LOCAL_RANK and LOCAL_WORLD_SIZE: they decide the placement (here the reverse
    of the ranks' order on the host), not the host name."""
    ckpt, (d1, d2, d3) = drives_of(tmp_path)
    envs = [{"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}]
    ok(launch(ckpt, tmp_path / "run", 2, *stripe_arg((d1, d2, d3)), steps=6, envs=envs))
    assert os.listdir(ckpt / "rank-00000") == ["DRIVE.json"] and striped_fulls(d1 / "rank-00000")
    assert striped_fulls(ckpt / "rank-00001")
    assert any(n.endswith(".lds") for n in os.listdir(d3 / "rank-00000"))
    assert any(n.endswith(".lds") for n in os.listdir(d2 / "rank-00001"))
