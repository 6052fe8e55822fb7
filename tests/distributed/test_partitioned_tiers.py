"""Partitioned directories with a shared tier, on real gloo processes (tiers_worker.py): each rank
drains its own rank directory into the shared tier's. A run SIGKILLed mid-way, its local directory
deleted (the nodes replaced), resumes from the shared tier (in one process, and with 2 ranks), byte for byte
the state of an uninterrupted run at the step the shared tier reached, never older; retention in
the shared tier counts its complete sets."""
import contextlib
import io
import os
import shutil
import socket
import sys
import time

import torch

import recovery
from lowdiff.cli import main as cli
from lowdiff.distributed.partition import rank_directories, rank_directory
from lowdiff.store.manifest import read_manifest
from recovery.tiers import tier_reach

sys.path.insert(0, os.path.dirname(__file__))
import forkserver  # noqa: E402
import partition_worker  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "tiers_worker.py")
STEPS = 14


def start_ranks(local, shared, digests, world, *extra):
    """Start ``world`` ranks (a list of processes); "{rank}" in ``local`` is replaced by the rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    return [forkserver.start([sys.executable, WORKER, "--rank", str(rank), "--world", str(world), "--port", str(port),
                              "--steps", str(STEPS), "--dir", str(local).format(rank=rank), "--shared-dir", str(shared),
                              "--digests", f"{digests}-{rank}.txt", *extra], env)
            for rank in range(world)]


def wait(*runs, timeout=240):
    """Wait for runs of ``start_ranks``; when a rank dies of SIGKILL the others of its run are killed too
    (as torchrun does). Returns [(exit code, stderr)] by rank, for each run."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for procs in runs for p in procs):
        for procs in runs:
            if any(p.returncode == -9 for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
        time.sleep(0.05)
    return [[(p.returncode, p.communicate()[1]) for p in procs] for procs in runs]


def launch(*args):
    return wait(start_ranks(*args))[0]


def ok(results):
    for code, err in results:
        assert code == 0, err
    return "".join(err for _, err in results)


def digests(path):
    """(resumed step, tier, {step: (full digest, shared digest)})."""
    resumed, tier, out = None, None, {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "resumed":
                resumed = int(parts[1])
                out[resumed] = (parts[2], parts[3])
            elif parts[0] == "tier":
                tier = parts[1]
            else:
                out[int(parts[0])] = (parts[1], parts[2])
    return resumed, tier, out


def test_killed_then_local_deleted_resumes_from_shared_exactly(tmp_path):
    # The uninterrupted reference and the run SIGKILLed at step 10, side by side. The reference's
    # ranks keep their local tiers in two roots, as on two nodes (neither sees the other's), and its
    # shared tier keeps every full set.
    ref_local, ref_shared = tmp_path / "ref-node{rank}", tmp_path / "ref-shared"
    local, shared = tmp_path / "local", tmp_path / "shared"
    reference, crashed = wait(start_ranks(ref_local, ref_shared, tmp_path / "ref", 2, "--shared-policy", "all"),
                              start_ranks(local, shared, tmp_path / "run", 2, "--crash-at", "10", "--crash-ranks", "1"))
    ok(reference)
    assert crashed[1][0] == -9
    ref = [digests(tmp_path / f"ref-{rank}.txt")[2] for rank in range(2)]
    assert ref[0][STEPS][0] != ref[1][STEPS][0]      # per-rank state differs: equal digests are a real check
    for rank in range(2):
        drained = read_manifest(rank_directory(ref_shared, rank))
        node = read_manifest(rank_directory(str(ref_local).format(rank=rank), rank))
        assert drained is not None and node is not None and node.files() <= drained.files()
        assert sorted(f.step for f in drained.fulls) == [0, 4, 8, 12]     # close() drained all; KeepAll kept all
        # A node's local tier (keep-last 2) learns which sets are complete from the shared tier: it
        # cleans although it cannot see the other node's shares (at most one set more while the
        # other rank's share of the newest set is still being drained).
        assert sorted(f.step for f in node.fulls) in ([8, 12], [4, 8, 12]), node.fulls
    assert tier_reach(str(ref_shared), None) == STEPS
    assert sorted(rank_directories(shared)) == [0, 1]
    reach = tier_reach(str(shared), None)            # what the shared tier holds after the kill
    assert reach >= 0
    shutil.rmtree(local)                              # the nodes are replaced
    # Another world size first: one process without a process group, a plain optimizer, the shares
    # of 2 ranks (and nothing written).
    torch.manual_seed(0)
    model = partition_worker.Net(unused=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    resumed = recovery.resume(local, model, opt, shared_dir=shared)
    assert (int(resumed), resumed.tier) == (reach, "shared")
    assert partition_worker.shared_digest(model, opt) == ref[0][reach][1]
    assert not local.exists()
    err = ok(launch(local, shared, tmp_path / "resumed", 2))
    assert "resuming from the shared tier" in err
    for rank in range(2):
        start, tier, got = digests(tmp_path / f"resumed-{rank}.txt")
        # (at wrap, the shared tier adopts a copy that was renamed but not yet listed at the kill)
        assert start >= reach and tier == "shared"
        assert got[start] == ref[rank][start], f"rank {rank}: state at step {start} differs"
        assert got[STEPS] == ref[rank][STEPS], f"rank {rank}: final state differs"
    # The new local tiers continue the shared tier's run; the shared tier keeps its policy (keep-last
    # 2) counting complete sets: both ranks keep the two newest sets. A rank that committed its last
    # share before the other rank's made that set complete still holds one older set (it learns of the
    # completion at its next commit): storage stays bounded.
    fulls = [sorted(f.step for f in read_manifest(rank_directory(shared, rank)).fulls) for rank in range(2)]
    assert fulls[0][-2:] == fulls[1][-2:] and all(2 <= len(f) <= 3 for f in fulls), fulls
    assert fulls[0][-1] == max(range(reach, STEPS + 1, 4))     # the resumed session's full every 4 steps
    assert read_manifest(rank_directory(local, 0)).run == read_manifest(rank_directory(shared, 0)).run
    # inspect shows both partitioned tiers and which one resume takes (both complete: the local one).
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["inspect", str(local)]) == 0
    assert "shared tier (local: keep-last 2; shared: keep-last 2" in out.getvalue()
    assert out.getvalue().count("share 1 of 2") >= 2
    assert f"resume        from the local tier, step {STEPS}" in out.getvalue()
