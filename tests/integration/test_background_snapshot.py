"""Full checkpoints copied in the background, while the next forward/backward pass runs.

The training thread only stages references at the iteration boundary; the copy into staging runs
on the persist thread. These tests check that what lands on disk is the boundary's state even
though training goes on (BatchNorm statistics change in the next forward pass, gradients are
rewritten), and that a change made in place outside step() is caught by the version counters:
that checkpoint is discarded, never committed torn.
"""
import copy
import os
import threading
import warnings

import pytest
import torch
from lowdiff_helpers import FULL_EVERY, build, train_steps, wrap

import fastio
import lowdiff
import recovery
from lowdiff.cli.demo import forward_backward, state_digest
from lowdiff.format.fullckpt import load_full
from lowdiff.store.manifest import read_manifest


def full_checkpoints(directory) -> dict:
    manifest = read_manifest(directory)
    return {f.step: os.path.join(directory, f.file) for f in manifest.fulls}


def trained(tmp_path, steps):
    """A fresh run wrapped in ``tmp_path/ckpt``, trained for ``steps`` steps."""
    directory = str(tmp_path / "ckpt")
    model, opt, sched, sampler = build()
    opt = wrap(directory, model, opt, sched, sampler)
    assert recovery.resume(directory, model, opt) == 0
    train_steps(model, opt, sched, sampler, 0, steps)
    return directory, model, opt, sched, sampler


def assert_model_in_checkpoint(path, expected: dict) -> dict:
    """The model tensors of the full checkpoint at ``path`` equal ``expected``; returns its state."""
    _, state = load_full(path)
    assert state.model.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state.model[key], value), key
    return state


def test_the_boundary_state_lands_on_disk_while_training_goes_on(tmp_path, monkeypatch):
    # Hold the background copy until the next forward/backward pass has run, so the test sees
    # what a slow copy of a large state would see.
    forward_done = threading.Event()
    real_copy = fastio.copy_regions

    def late_copy(*args, **options):
        assert forward_done.wait(30)
        return real_copy(*args, **options)
    monkeypatch.setattr(fastio, "copy_regions", late_copy)
    directory, model, opt, _, sampler = trained(tmp_path, FULL_EVERY)
    # step() returned with the full checkpoint of step FULL_EVERY staged, not yet copied or judged
    assert opt._fulls._pending_copy is not None
    expected_model = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moments = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forward_backward(model, sampler)   # BatchNorm running statistics change in place
        forward_done.set()
        opt.step()                         # waits for the copy before changing parameters
        opt.flush()
    state = assert_model_in_checkpoint(full_checkpoints(directory)[FULL_EVERY], expected_model)
    assert any(not torch.equal(a, b) for a, b in zip(expected_model.values(), model.state_dict().values()))
    stored = state.optimizer["state"]
    for i, moment in enumerate(expected_moments):
        assert torch.equal(stored[i]["exp_avg"], moment)
    opt.close()


def test_a_change_in_place_outside_step_discards_that_checkpoint(tmp_path):
    directory, model, opt, sched, sampler = trained(tmp_path, FULL_EVERY)
    with torch.no_grad():
        model[0].weight.mul_(0.5)          # outside step(): the staged state is no longer the boundary's
    forward_backward(model, sampler)
    with pytest.warns(RuntimeWarning) as caught:
        opt.step()
    messages = [str(w.message) for w in caught]
    assert any("0.weight changed in place after step 6 outside optimizer.step(); the full checkpoint of "
               "step 6 is discarded" in m for m in messages), messages
    after_change = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(model, opt, sched, sampler, FULL_EVERY + 1, 2 * FULL_EVERY + 1)
    opt.flush()
    fulls = full_checkpoints(directory)
    assert FULL_EVERY not in fulls                  # discarded, not committed torn
    assert not [n for n in os.listdir(directory) if ".tmp-" in n]
    # the change forced a full checkpoint at the end of the next step; it and later ones are
    # copied before step() returns, and hold the state of their step
    assert not opt._fulls.background_copy
    assert sorted(fulls) == [0, FULL_EVERY + 1, 2 * FULL_EVERY + 1]
    assert_model_in_checkpoint(fulls[FULL_EVERY + 1], after_change)
    assert_model_in_checkpoint(fulls[2 * FULL_EVERY + 1], model.state_dict())
    opt.close()


def test_a_change_outside_step_forces_a_full_checkpoint_so_resume_stays_exact(tmp_path):
    """Replay cannot redo a change made outside step(); the full checkpoint taken at the end of
    the next step makes every later step resumable exactly again. Warned once."""
    directory, model, opt, sched, sampler = trained(tmp_path, 2)
    digests = {}

    def remember(step):
        digests[step] = state_digest(model, opt, sched, sampler)
    with torch.no_grad():
        model[4].bias.add_(1.0)            # like loading new weights by hand between steps
    with pytest.warns(RuntimeWarning, match=r"^lowdiff: 4\.bias changed after step 2, outside step\(\)"):
        train_steps(model, opt, sched, sampler, 2, 4, remember)
    first = opt.param_groups[0]["params"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")     # shown once
        opt.state[first]["exp_avg_sq"].mul_(2.0)              # optimizer state, in place
        train_steps(model, opt, sched, sampler, 4, 5, remember)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # same values, new tensors: replaced
        train_steps(model, opt, sched, sampler, 5, 7, remember)
    stats = opt.stats()
    opt.close()
    assert stats["outside_changes"] == 3
    assert {3, 5, 6} <= set(full_checkpoints(directory))  # forced at the end of each step that found a change
    model2, opt2, sched2, sampler2 = build()
    opt2 = wrap(directory, model2, opt2, sched2, sampler2)
    assert recovery.resume(directory, model2, opt2, scheduler=sched2, extra_state={"sampler": sampler2}) == 7
    assert state_digest(model2, opt2, sched2, sampler2) == digests[7]
    opt2.close()


@pytest.mark.parametrize("change, named", [
    (lambda opt, first: opt.state[first]["exp_avg_sq"].mul_(2.0), "0.weight (optimizer state 'exp_avg_sq')"),
    (lambda opt, first: opt.load_state_dict(copy.deepcopy(opt.state_dict())), "0.bias (optimizer state 'exp_avg')"),
], ids=["in-place", "replaced"])
def test_the_warning_names_the_optimizer_state_that_changed(tmp_path, change, named):
    directory, model, opt, sched, sampler = trained(tmp_path, 2)
    change(opt, opt.param_groups[0]["params"][0])
    with pytest.warns(RuntimeWarning, match="outside step") as caught:
        train_steps(model, opt, sched, sampler, 2, 3)
    opt.close()
    assert any(named in str(w.message) for w in caught), [str(w.message) for w in caught]


def test_close_right_after_a_full_step_commits_it(tmp_path):
    directory, model, opt, _, _ = trained(tmp_path, FULL_EVERY)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    assert_model_in_checkpoint(full_checkpoints(directory)[FULL_EVERY], expected)


def rewrite_index(path: str, change) -> None:
    """Replace the index of a full checkpoint by ``change(index)`` (a valid trailer follows)."""
    from lowdiff.format import container
    from lowdiff.format.fullckpt import read_full_index
    index = read_full_index(path).to_json()
    with open(path, "rb") as f:
        data = f.read()
    index_offset = container.TRAILER.unpack(data[-container.TRAILER.size:])[0]
    encoded = container.encode_index(change(index))
    with open(path, "wb") as f:
        f.write(data[:index_offset] + encoded + container.trailer_bytes(index_offset, encoded, container.KIND_FULL))


def test_checksums_old_and_missing(tmp_path):
    """Files written before CRC-32C carry zlib CRC-32 as "crc32" and still load; an entry with no
    checksum at all is an error that names the file."""
    import zlib

    from lowdiff.errors import CorruptCheckpointError
    directory, _, opt, _, _ = trained(tmp_path, FULL_EVERY)
    opt.close()
    path = full_checkpoints(directory)[FULL_EVERY]
    _, want = load_full(path)
    with open(path, "rb") as f:
        data = f.read()

    def as_zlib(index):
        for entry in index["tensors"] + [index["objects"]]:
            start = entry["offset"]
            assert zlib.crc32(data[start:start + entry["nbytes"]]) != entry["crc32c"] or entry["nbytes"] == 0
            entry["crc32"] = zlib.crc32(data[start:start + entry["nbytes"]])
            del entry["crc32c"]
        return index
    rewrite_index(path, as_zlib)
    assert_model_in_checkpoint(path, want.model)

    def without_checksum(index):
        del index["tensors"][0]["crc32"]
        return index
    rewrite_index(path, without_checksum)
    with pytest.raises(CorruptCheckpointError, match=r"full-.*no checksum"):
        load_full(path)


def test_stats_count_what_checkpointing_did(tmp_path):
    directory, _, opt, _, _ = trained(tmp_path, 2 * FULL_EVERY + 1)  # batch_steps=3: fulls 0, 6, 12
    opt.flush()
    stats = opt.stats()
    opt.close()
    assert stats["step"] == 2 * FULL_EVERY + 1 and stats["full_every"] == FULL_EVERY
    assert stats["background_copy"] is True
    assert stats["full_stall_count"] == 3 and stats["full_persist_count"] == 3
    assert stats["batch_write_count"] == len(read_manifest(directory).batches) == 5  # 1-3 4-6 7-9 10-12 13
    for key in ("full_stall", "full_persist", "batch_write"):
        assert 0 <= stats[f"{key}_median_ms"] <= stats[f"{key}_max_ms"]
    # What a full checkpoint cost the iterations: the one of step 6 is charged by the time step 12
    # takes the next (that of step 12 only once a clean step follows it).
    assert stats["full_iteration_cost_count"] >= 1 and stats["full_iteration_cost_median_ms"] >= 0


def test_full_copy_in_step_copies_before_step_returns_and_resumes_exactly(tmp_path):
    """Options(full_copy="in_step"): the state is in staging when step() returns (no background
    copy is pending), and what it wrote resumes to the uninterrupted run's state."""
    def run(directory, steps, full_copy):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        opt = lowdiff.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), model, str(directory),
                           compressor=lowdiff.Dense(), full_every=3, batch_steps=2,
                           options=lowdiff.Options(full_copy=full_copy))
        pending = []
        for step in range(steps):
            g = torch.Generator().manual_seed(step)
            model(torch.randn(4, 8, generator=g)).square().mean().backward()
            opt.step()
            pending.append(opt._fulls._pending_copy is not None)
            opt.zero_grad()
        background = opt.stats()["background_copy"]
        opt.close()
        return model, pending, background

    ref, pending, background = run(tmp_path / "bg", 9, "background")
    assert background and any(pending)            # the default copies beside the next iteration
    _, pending, background = run(tmp_path / "in", 9, "in_step")
    assert not background and not any(pending)    # never a copy left for the next step
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    assert sorted(f.step for f in read_manifest(str(tmp_path / "in")).fulls)[-1] == 9
    assert recovery.resume(str(tmp_path / "in"), fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2)) == 9
    for a, b in zip(ref.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="full_copy"):
        lowdiff.Options(full_copy="later")


def test_staging_is_registered_with_the_engine_while_training_and_let_go_at_close(tmp_path):
    # Fixed I/O: the engine pins the staging pages once, not at every write, and holds the buffer
    # while registered; close() must let it go, or the process-wide engine would keep it forever.
    engine = fastio.engine()
    if engine.name != "uring":
        pytest.skip(f"fixed I/O is io_uring's: this process uses {engine.name}")
    directory, model, opt, sched, sampler = trained(tmp_path, 2 * FULL_EVERY)
    opt.flush()
    staging = opt._fulls._snapshot._buffer
    if engine.registered is not staging:
        pytest.skip("the kernel refused the registration (memlock limit?)")
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    opt.close()
    assert engine.registered is None
    # What the registered staging wrote is the state, byte for byte.
    newest = max(full_checkpoints(directory).items())[1]
    assert_model_in_checkpoint(newest, reference)
