"""full_every="auto" and batch_steps="auto" run end to end, and resume stays exact; settings that
change in the middle of a run (as the controller's decisions do) leave every step replayable."""
import torch
from lowdiff_helpers import build, reference_digests, resumed_digest, train_steps, wrap

import lowdiff
import recovery
from lowdiff.cli.demo import state_digest

STEPS = 40


def run(directory, steps, *, resume):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = lowdiff.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model, directory,
                       compressor=lowdiff.Dense(), schedule=lowdiff.Auto(failure_rate_per_hour=3600.0))
    start = recovery.resume(directory, model, opt) if resume else 0
    for step in range(start, steps):
        g = torch.Generator().manual_seed(step)
        loss = model(torch.randn(8, 16, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    decisions, stats = opt.controller.describe(), opt.stats()
    opt.close()
    return model, decisions, stats, start


def test_auto_settings_measure_decide_and_resume_exactly(tmp_path):
    ref, decisions, stats, _ = run(tmp_path / "ref", STEPS, resume=False)
    assert decisions["step_s"] is not None and decisions["persist_s"] is not None
    assert decisions["decisions"] >= 1 and decisions["full_every"] >= 1 and decisions["batch_steps"] >= 1
    history = stats["controller"]["history"]
    assert history[-1]["full_every"] == stats["full_every"] and history[-1]["batch_steps"] == stats["batch_steps"]
    assert stats["controller"]["costs"]["replay_s"] > 0
    run(tmp_path / "run", 23, resume=False)
    model, _, _, start = run(tmp_path / "run", STEPS, resume=True)
    assert start == 23
    for a, b in zip(ref.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_settings_changing_mid_run_keep_every_chain_replayable(tmp_path, rng):
    """Both settings change every few steps, as an auto controller's decisions would: batches of
    every size and full checkpoints at irregular steps. Every retained step resumes exactly."""
    directory = tmp_path / "ckpt"
    model, opt, sched, sampler = build()
    opt = wrap(str(directory), model, opt, sched, sampler, full_every="auto", batch_steps="auto",
               retention=lowdiff.KeepLast(100))
    digests = {0: state_digest(model, opt, sched, sampler)}
    changes = []

    def decide(step):
        digests[step] = state_digest(model, opt, sched, sampler)
        if step % 3 == 0:  # a decision: what the controller would apply from its own thread
            opt.controller.full_every, opt.controller.batch_steps = int(rng.integers(2, 9)), int(rng.integers(1, 6))
            changes.append((step, opt.controller.full_every, opt.controller.batch_steps))

    try:
        train_steps(model, opt, sched, sampler, 0, 30, decide)
        opt.flush()
    finally:
        opt.close()
    assert len({c[1:] for c in changes}) > 3
    for step in range(31):
        assert resumed_digest(directory, step) == (step, digests[step]), f"step {step} (changes {changes})"


def test_batch_steps_shrinking_below_the_records_held_does_not_stall_training(tmp_path):
    """The writer holds 4 records of a batch of 5 when batch_steps drops to 2: those 4 already
    fill a batch, and with one batch allowed in flight the next step() must not wait for a record
    that never comes (it used to wait forever: CI hung here). The run stays exact."""
    import threading
    import time

    digests = reference_digests(8)
    directory = tmp_path / "ckpt"
    model, opt, sched, sampler = build()
    opt = wrap(str(directory), model, opt, sched, sampler, full_every=100, batch_steps=5,
               options=lowdiff.Options(max_pending_batches=1))

    def shrink(step):
        if step == 4:
            # Let the writer take in the records queued so far first: the hang needs them held.
            while not opt._session.diffs._queue.empty():
                time.sleep(0.001)
            time.sleep(0.05)
            opt.controller.batch_steps = 2

    def train():
        try:
            train_steps(model, opt, sched, sampler, 0, 8, shrink)
        finally:
            opt.close()

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    trainer.join(timeout=120)   # a deadlock detector, not a timing: the run takes well under a second
    assert not trainer.is_alive(), "step() blocked for good after batch_steps shrank"
    assert resumed_digest(directory, None) == (8, digests[8])
