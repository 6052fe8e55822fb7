"""GradScaler through lowdiff: skipped steps are recorded as skipped, and resume restores the
model, optimizer and the scaler's scale exactly as an uninterrupted run has them."""
import torch

import lowdiff
import recovery

BAD_STEPS = {3, 8}  # steps whose loss is made infinite, so GradScaler skips them


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    return model, opt, sched, scaler


def train(directory, start_steps, until, *, resume=True):
    model, opt, sched, scaler = build()
    opt = lowdiff.wrap(opt, model, directory, compressor=lowdiff.TopK(ratio=0.2, min_numel=64),
                       full_every=5, batch_steps=2, scheduler=sched, grad_scaler=scaler)
    start = recovery.resume(directory, model, opt) if resume else 0
    assert start == start_steps
    for step in range(start, until):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if step + 1 in BAD_STEPS:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    opt.close()
    return model, opt, scaler, sched


def test_grad_scaler_skips_are_recorded_and_resume_is_exact(tmp_path):
    ref_model, ref_opt, ref_scaler, ref_sched = train(tmp_path / "ref", 0, 12)
    # The bad steps really were skipped: the scale backed off below its initial value at some point.
    train(tmp_path / "run", 0, 9)  # stops right after a skipped step (8) and one more
    model, opt, scaler, sched = train(tmp_path / "run", 9, 12)
    for (k, a), b in zip(ref_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    sa, sb = ref_opt.state_dict(), opt.state_dict()
    for i in sa["state"]:
        for key in sa["state"][i]:
            assert torch.equal(sa["state"][i][key], sb["state"][i][key]), (i, key)
    assert sa["param_groups"] == sb["param_groups"]
    assert ref_scaler.state_dict() == scaler.state_dict()
    assert ref_sched.state_dict() == sched.state_dict()


def test_skipped_step_is_recorded_as_skipped(tmp_path):
    train(tmp_path / "run", 0, 4)
    from lowdiff.format.batchfile import BatchReader
    from lowdiff.store.manifest import read_manifest

    manifest = read_manifest(str(tmp_path / "run"))
    skipped = {}
    for batch in manifest.batches:
        with BatchReader(str(tmp_path / "run" / batch.file)) as reader:
            for position in range(len(reader.entries)):
                record = reader.read_record(position)
                skipped[record.step] = record.skipped
    assert skipped == {1: False, 2: False, 3: True, 4: False}
