"""DCP interop (issue #31, item 5): ``python -m lowdiff export --format dcp`` writes a
torch.distributed.checkpoint directory that a fresh FSDP2 model and optimizer load with
get_state_dict / dcp.load / set_state_dict at any world size, equal byte for byte (gathered) to the
uninterrupted run at that step; and a lowdiff run started from such a checkpoint continues from it
exactly, through a SIGKILL and lowdiff's own resume. Before, ``export`` had no ``--format``. The
export of a sharded directory is sharded: each rank's chunks at their global offsets, one file per
rank, as the job's own DCP save writes them (it was whole tensors gathered in one process)."""
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import forkserver  # noqa: E402
from partition_runs import free_port  # noqa: E402
from test_fsdp2_resume import copied, damage_rank_1s_newest_chunk, digests, launch, ok  # noqa: E402

DCP_WORKER = os.path.join(os.path.dirname(__file__), "fsdp2_dcp_worker.py")
STEPS, K = 10, 5


def launch_dcp(checkpoint, out, world, *extra):
    """``world`` ranks of fsdp2_dcp_worker.py; (return code, stderr) by rank."""
    port = free_port()
    procs = [forkserver.start([sys.executable, DCP_WORKER, "--rank", str(rank), "--world", str(world), "--port",
                               str(port), "--steps", str(STEPS), "--dcp", str(checkpoint), "--digests",
                               f"{out}-{rank}.txt", *extra]) for rank in range(world)]
    results = []
    for p in procs:
        try:
            results.append((p.wait(timeout=180), p.communicate()[1]))
        except subprocess.TimeoutExpired:
            p.kill()
            results.append((p.wait(), "timed out"))
    return results


def lines(path):
    with open(path) as f:
        return [line.split() for line in f]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-rank FSDP2 run of fsdp2_worker.py (Dense, AdamW), its gathered digests by step, and its
    step K exported to DCP by the CLI."""
    base = tmp_path_factory.mktemp("dcp")
    ok(launch(base / "run", base / "ref", 2))
    out = base / "exported"
    result = subprocess.run([sys.executable, "-m", "lowdiff", "export", str(base / "run"), "--step", str(K),
                             "--format", "dcp", "-o", str(out)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert f"exported step {K}" in result.stdout
    return digests(base / "ref-0.txt", column=-2)[1], out, base / "run"


def chunks_of(checkpoint) -> dict:
    """{key: [(offsets, sizes), ...]} of the DCP directory's tensors, and its data files."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    return {key: [(list(c.offsets), list(c.sizes)) for c in md.chunks]
            for key, md in metadata.state_dict_metadata.items() if hasattr(md, "chunks")}


def test_the_export_of_a_sharded_directory_is_sharded(exported):
    """Each rank's chunks at their global offsets, in that rank's file; the replicated rest (AdamW's
    step counts) once, whole. Nothing was gathered into whole tensors."""
    _, checkpoint, _ = exported
    assert sorted(n for n in os.listdir(checkpoint) if n.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    chunks = chunks_of(checkpoint)
    assert chunks["0.weight"] == [([0, 0], [12, 8]), ([12, 0], [12, 8])]
    assert chunks["state.3.weight.exp_avg_sq"] == [([0, 0], [3, 24]), ([3, 0], [2, 24])]   # 5 rows: 3 and 2
    assert chunks["state.0.weight.step"] == [([], [])]


# 2 ranks with -m soak: test_fsdp2_hsdp.py loads an export with these chunks (rows 0..12, 12..24) at 2
# ranks by default; 1 rank (every chunk resharded into whole tensors) here.
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.soak)])
def test_dcp_load_at_any_world_size_equals_the_run_at_that_step(tmp_path, exported, world):
    reference, checkpoint, _ = exported
    ok(launch_dcp(checkpoint, tmp_path / "load", world, "--load-only"))
    for rank in range(world):
        (loaded,) = lines(tmp_path / f"load-{rank}.txt")
        assert loaded == ["loaded", str(K), reference[K]], rank


def test_a_lowdiff_run_started_from_dcp_continues_from_it_exactly(tmp_path, exported):
    """The guide's recipe (load DCP before lowdiff.wrap): the run is the same as one without lowdiff
    from the same checkpoint, step by step, also after every rank is SIGKILLed after step K + 3
    and lowdiff resumes it from its own directory (which counts steps from the DCP state)."""
    reference, checkpoint, _ = exported
    ok(launch_dcp(checkpoint, tmp_path / "plain", 2))
    crashed = launch_dcp(checkpoint, tmp_path / "run", 2, "--lowdiff", str(tmp_path / "ckpt"), "--crash-at",
                         str(K + 3))
    assert [code for code, _ in crashed] == [-9, -9], crashed
    ok(launch_dcp(checkpoint, tmp_path / "res", 2, "--lowdiff", str(tmp_path / "ckpt")))
    for rank in range(2):
        plain = lines(tmp_path / f"plain-{rank}.txt")
        assert plain[0] == ["loaded", str(K), reference[K]] and [int(s) for s, _ in plain[1:]] == \
            list(range(K + 1, STEPS + 1))
        expected = dict(plain[1:])
        run = lines(tmp_path / f"run-{rank}.txt")
        assert run[0] == plain[0] and dict(run[1:]) == {s: expected[s] for s in map(str, range(K + 1, K + 4))}
        resumed = lines(tmp_path / f"res-{rank}.txt")
        assert resumed[0][0] == "loaded" and int(resumed[0][1]) > K   # resumed past the DCP state
        assert resumed[1:] and dict(resumed[1:]) == {s: expected[s] for s, _ in resumed[1:]}
        assert resumed[-1][0] == str(STEPS)


def test_shares_starting_from_different_sets_export_whole_tensors(tmp_path, exported):
    """Rank 1's chunk of the newest set (step 8) is damaged: share 1's state can only start from step
    4's set. The export says so and writes whole tensors (every share's chunks read and checked,
    from the set they all verify), still the run's state at the newest step."""
    reference, _, run = exported
    directory = copied(run, tmp_path / "run")
    assert damage_rank_1s_newest_chunk(directory) == 8
    out = tmp_path / "exported"
    result = subprocess.run([sys.executable, "-m", "lowdiff", "export", str(directory), "--format", "dcp", "-o",
                             str(out)], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert "share 1 of step 10 starts from the full checkpoint of step 4, share 0 from step 8" in result.stderr
    assert "exporting whole tensors" in result.stderr and f"exported step {STEPS}" in result.stdout
    assert chunks_of(out)["0.weight"] == [([0, 0], [24, 8])]
    assert sorted(n for n in os.listdir(out) if n.endswith(".distcp")) == ["__0_0.distcp"]   # no stray share file
    ok(launch_dcp(out, tmp_path / "load", 1, "--load-only"))
    assert lines(tmp_path / "load-0.txt") == [["loaded", str(STEPS), reference[STEPS]]]


def test_an_unsharded_run_exports_to_dcp_in_process(tmp_path):
    """Without FSDP (one process, no process group, called in-process as recovery.export): the DCP
    directory holds exactly get_state_dict's flattened keys and values at the step asked for, past
    the full checkpoint (replayed), and exporting raises no warning (DCP warns on every no_dist save)."""
    import copy
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import lowdiff
    import recovery

    options = StateDictOptions(flatten_optimizer_state_dict=True)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, inner = build()
    opt = lowdiff.wrap(inner, model, str(tmp_path / "ckpt"), compressor=lowdiff.Dense(), full_every=3, batch_steps=1)
    states = {}
    for step in range(1, 7):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        model_sd, optim_sd = get_state_dict(model, inner, options=options)
        states[step] = copy.deepcopy({**model_sd, **optim_sd})
    opt.close()
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(ValueError, match="file: exists and is not a directory"):
        recovery.export(str(tmp_path / "ckpt"), str(tmp_path / "file"), step=4, format="dcp")
    assert recovery.export(str(tmp_path / "ckpt"), str(tmp_path / "out"), step=4, format="dcp") == 4
    model, inner = build()
    model_sd, optim_sd = get_state_dict(model, inner, options=options)
    loaded = {**model_sd, **optim_sd, "lowdiff.step": 0}
    with warnings.catch_warnings():   # the loader's own no_dist warning
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(loaded, checkpoint_id=str(tmp_path / "out"), no_dist=True)
    assert set(dcp.FileSystemReader(str(tmp_path / "out")).read_metadata().state_dict_metadata) == set(loaded)
    assert loaded.pop("lowdiff.step") == 4 and set(loaded) == set(states[4])
    for key, want in states[4].items():
        got = loaded[key]
        assert torch.equal(got, want) if isinstance(want, torch.Tensor) else got == want, key
