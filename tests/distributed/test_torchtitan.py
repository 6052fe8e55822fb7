"""torchtitan (issue #31 item 8): its own Trainer, llama3 "debugmodel" under FSDP2 on 2 gloo ranks
(CPU), with lowdiff.integrations.torchtitan.LowDiffCheckpointManager in place of its DCP checkpoint
manager. After a SIGKILL of every rank the restarted job's Trainer.train() resumes each rank's state
(its chunks of the parameters and AdamW state, param groups, LR schedulers, dataloader position,
trainer step and token count, RNG) byte for byte as the uninterrupted run had it, and trains on
identically. Runs where torchtitan 0.3.0 is installed (pip install 'lowdiff[titan]'); skipped,
saying so, elsewhere."""
import importlib.metadata
import importlib.util
import json
import os
import random
import sys

import pytest
import torch

import recovery

sys.path.insert(0, os.path.dirname(__file__))
import partition_runs  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "titan_worker.py")
STEPS = 10
TESTED = "0.3.0"


def _titan_version():
    if importlib.util.find_spec("torchtitan") is None:
        return None
    return importlib.metadata.version("torchtitan")


pytestmark = pytest.mark.skipif(_titan_version() != TESTED,
                                reason=f"torchtitan {TESTED} is not installed (found {_titan_version()}): "
                                       f"pip install 'lowdiff[titan]'")

WORDS = ["checkpoint", "gradient", "shard", "rank", "step", "model", "optimizer", "state", "disk", "resume",
         "differential", "replay", "exact", "byte", "tensor", "chunk", "mesh", "batch", "token", "train"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A word-level tokenizer (torchtitan reads tokenizer.json and its special tokens from
    tokenizer_config.json) and a small text dataset in the layout datasets.load_dataset reads from
    a folder: nothing is downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    base = tmp_path_factory.mktemp("titan-assets")
    vocab = {"[UNK]": 0, "<|begin_of_text|>": 1, "<|end_of_text|>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (base / "tokenizer").mkdir()
    tokenizer.save(str(base / "tokenizer" / "tokenizer.json"))
    (base / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    rng = random.Random(5)
    (base / "data").mkdir()
    with open(base / "data" / "train.jsonl", "w") as f:
        for _ in range(400):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40)))}) + "\n")
    return base


@pytest.fixture(autouse=True)
def offline(assets, monkeypatch):
    """The ranks read the dataset from the folder (no hub), with their cache under the test's files."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(assets / "hf-cache"))


def launch(assets, directory, digests, *extra):
    return partition_runs.launch(directory, digests, 2, "--tokenizer", str(assets / "tokenizer"),
                                 "--data", str(assets / "data"), *extra, steps=STEPS, worker=WORKER, timeout=600)


def digests(path):
    """(resumed step, {step: digest})."""
    resumed, out = None, {}
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "resumed":
                resumed = int(parts[1])
                out[resumed] = parts[2]
            else:
                out[int(parts[0])] = parts[1]
    return resumed, out


def assert_gathered(got: dict, want_path, what: str, split_kept: bool = False):
    """``got`` (an export's {model, optimizer}) equals the reference run's gathered state at that
    step: every parameter under its own name (the fused wqkv, which state_dict() splits) and every
    optimizer state tensor, byte for byte; state_dict()'s split wq/wk/wv only where ``split_kept``
    (an export of a full checkpoint's own step keeps them as stored)."""
    want = torch.load(want_path, weights_only=True)
    for name, tensor in want["params"].items():
        assert torch.equal(got["model"][name], tensor), (what, name)
    split = [k for k in got["model"] if k.endswith(("wq.weight", "wk.weight", "wv.weight"))]
    assert len(split) == (3 * len([n for n in want["params"] if n.endswith("wqkv.weight")]) if split_kept else 0), \
        (what, split)
    assert set(got["optimizer"]["state"]) == set(want["optimizer"]), what
    for slot, entry in want["optimizer"].items():
        for key, value in entry.items():
            assert torch.equal(got["optimizer"]["state"][slot][key], value), (what, slot, key)


def export_state(directory, out) -> tuple[dict, bool]:
    """(the export of the newest durable step, whether that step is a full checkpoint's)."""
    step = recovery.export(directory, out)
    exported = torch.load(out, weights_only=True)
    assert exported["step"] == step
    return exported, any(path.name.startswith(f"full-{step:012d}-") for path in directory.rglob("full-*"))


# TopK's run is the same three jobs again: with -m soak (the suite's time budget). Dense runs under
# torchtitan's default mixed_precision_param="bfloat16" (bfloat16 compute, float32 reduction; the
# optimizer steps float32 chunks), TopK under "float32" (FSDP2 casts nothing).
@pytest.mark.parametrize("compressor,precision", [
    ("dense", "bfloat16"), pytest.param("topk", "float32", marks=pytest.mark.soak)])
def test_torchtitan_trainer_resumes_exactly_after_sigkill(tmp_path, assets, compressor, precision):
    extra = ("--compressor", compressor, "--mixed-precision", precision)
    # The reference run also writes its gathered state after the steps a resume or export below
    # may reach (the durable step after the kill at 7 is 4 to 7).
    partition_runs.ok(launch(assets, tmp_path / "ref", tmp_path / "ref", *extra, "--dump-states",
                             str(tmp_path / "state"), "--dump-steps", "4", "5", "6", "7", str(STEPS)))
    reference = [digests(tmp_path / f"ref-{rank}.txt") for rank in range(2)]
    for resumed, steps in reference:
        assert resumed == 0 and sorted(steps) == list(range(STEPS + 1))
    crashed = launch(assets, tmp_path / "run", tmp_path / "run", "--crash-at", "7", *extra)
    assert [code for code, _ in crashed] == [-9, -9], crashed
    # The killed job's directory exports (one process, no model code, gathered) the state of its
    # newest durable step, as the reference run had it.
    exported, full = export_state(tmp_path / "run" / "lowdiff", tmp_path / "killed.pt")
    assert exported["step"] >= 4
    assert_gathered(exported, tmp_path / f"state-{exported['step']}.pt", "export after SIGKILL", full)
    partition_runs.ok(launch(assets, tmp_path / "run", tmp_path / "res", *extra))
    resumed_at = set()
    for rank in range(2):
        step, got = digests(tmp_path / f"res-{rank}.txt")
        resumed_at.add(step)
        # full_every 4, batch_steps 2, killed after step 7 without a flush: step 4's full set is
        # durable at least; the differentials after it are replayed.
        assert step >= 4 and sorted(got) == list(range(step, STEPS + 1)), (step, sorted(got))
        for s, value in got.items():
            assert value == reference[rank][1][s], (rank, s)
    assert len(resumed_at) == 1
    exported, full = export_state(tmp_path / "run" / "lowdiff", tmp_path / "end.pt")
    assert exported["step"] == STEPS
    assert_gathered(exported, tmp_path / f"state-{STEPS}.pt", "export of the resumed run's end", full)
    # Its model and optimizer state resume at 1 rank as the 2-rank run had them, gathered (the
    # optimizer state of the fused wqkv, which state_dict() does not hand out, included). Not its
    # dataloader: torchtitan's own refuses a state of another dp degree ("dataloader resharding is
    # not supported yet"), from its DCP checkpoints as well.
    partition_runs.ok(partition_runs.launch(
        tmp_path / "one", tmp_path / "one", 1, "--tokenizer", str(assets / "tokenizer"), "--data",
        str(assets / "data"), "--reshard-from", str(tmp_path / "run" / "lowdiff"), "--dump-states",
        str(tmp_path / "one-state"), *extra, steps=STEPS, worker=WORKER, timeout=600))
    assert (tmp_path / "one-0.txt").read_text().split() == ["resharded", str(STEPS)]
    got = torch.load(tmp_path / f"one-state-{STEPS}.pt", weights_only=True)
    assert_gathered({"model": got["params"], "optimizer": {"state": got["optimizer"]}},
                    tmp_path / f"state-{STEPS}.pt", "resumed at one rank")


@pytest.mark.parametrize("setting,words", [
    ({"initial_load_path": "/runs/dcp/step-100"}, "initial_load_path='/runs/dcp/step-100') is not supported"),
    ({"last_save_in_hf": True}, "last_save_in_hf=True) is not supported"),
    ({"load_only": True}, "load_only=True) is not supported"),
    ({"exclude_from_loading": ["dataloader"]}, "exclude_from_loading=['dataloader']) is not supported"),
    ({"compressor": "zstd"}, "compressor='zstd'"),
    ({"full_every": 0}, "full_every=0) must be >= 1"),
])
def test_settings_lowdiff_does_not_carry_out_are_refused_by_name(setting, words):
    from lowdiff.integrations.torchtitan import LowDiffCheckpointManager

    with pytest.raises(ValueError) as refused:
        LowDiffCheckpointManager.Config(**setting)
    assert words in str(refused.value)
