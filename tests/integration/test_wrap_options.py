"""wrap()'s keywords before the option objects still work: each warns (DeprecationWarning at the
caller's line) naming its new spelling, and gives the settings that spelling gives. The main
directory takes any retention policy."""
import os

import pytest
import torch

import fastio
import lowdiff
from lowdiff.store.inventory import take_inventory


def objects():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return torch.optim.SGD(model.parameters(), lr=0.1), model


def train(opt, model, steps):
    for _ in range(steps):
        model(torch.randn(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()


# (old keywords, the new spelling the warning names, the same settings in the new spelling)
CASES = {
    "keep_full": ({"keep_full": 3}, "retention=lowdiff.KeepLast(3)", {"retention": lowdiff.KeepLast(3)}),
    "differentials": ({"differentials": False, "full_every": 5},
                      "schedule=lowdiff.Fixed(full_every=5, batch_steps=10, differentials=False)",
                      {"schedule": lowdiff.Fixed(full_every=5, differentials=False)}),
    "failure_rate_per_hour": ({"full_every": "auto", "failure_rate_per_hour": 2.0}, "schedule=lowdiff.Auto(",
                              {"schedule": lowdiff.Auto(batch_steps=10, failure_rate_per_hour=2.0)}),
    # Fixed settings keep the limits too: stats() judges them by the failure rate and the bounds.
    "limits-fixed": ({"failure_rate_per_hour": 2.0, "max_recovery_s": 30.0},
                     "schedule=lowdiff.Fixed(full_every=100, batch_steps=10, differentials=True, "
                     "failure_rate_per_hour=2.0, max_recovery_s=30.0)",
                     {"schedule": lowdiff.Fixed(failure_rate_per_hour=2.0, max_recovery_s=30.0)}),
    "max_recovery_s": ({"batch_steps": "auto", "max_recovery_s": 30.0}, "max_recovery_s=30.0",
                       {"schedule": lowdiff.Auto(full_every=100, max_recovery_s=30.0)}),
    "batch_memory_bytes": ({"batch_steps": "auto", "batch_memory_bytes": 2**20}, "batch_memory_bytes=1048576",
                           {"schedule": lowdiff.Auto(full_every=100, batch_memory_bytes=2**20)}),
    "differentials-auto": ({"differentials": "auto", "full_every": 20, "batch_steps": 4},
                           "schedule=lowdiff.Auto(full_every=20, batch_steps=4, differentials='auto'",
                           {"schedule": lowdiff.Auto(full_every=20, batch_steps=4, differentials="auto")}),
    "replica": ({"replica": True, "full_every": 4}, "schedule=lowdiff.Replica(full_every=4, batch_steps=10",
                {"schedule": lowdiff.Replica(full_every=4)}),
    "replica_inflight_steps": ({"replica": True, "replica_inflight_steps": 3}, "inflight_steps=3",
                               {"schedule": lowdiff.Replica(inflight_steps=3)}),
    "max_pending_batches": ({"max_pending_batches": 1}, "options=lowdiff.Options(max_pending_batches=1)",
                            {"options": lowdiff.Options(max_pending_batches=1)}),
    "overwrite": ({"overwrite": True}, "options=lowdiff.Options(overwrite=True)",
                  {"options": lowdiff.Options(overwrite=True)}),
    "boundary": ({"boundary": "manual"}, "options=lowdiff.Options(boundary='manual')",
                 {"options": lowdiff.Options(boundary="manual")}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_old_keyword_works_and_warns_with_its_new_spelling(tmp_path, case):
    old, spelling, new = CASES[case]
    opt, model = objects()
    with pytest.warns(DeprecationWarning) as caught:
        wrapped = lowdiff.wrap(opt, model, tmp_path / "old", **old)
    try:
        messages = [str(w.message) for w in caught]
        assert any(spelling in m for m in messages), messages
        for name in set(old) - {"full_every", "batch_steps"}:
            assert any(f"wrap({name}=...) is deprecated" in m for m in messages), (name, messages)
        assert {w.filename for w in caught} == {__file__}     # the caller's line, not lowdiff's
        opt2, model2 = objects()
        with lowdiff.wrap(opt2, model2, tmp_path / "new", **new) as spelled_anew:
            assert wrapped.config == spelled_anew.config
    finally:
        wrapped.close()


def test_old_shared_dir_is_tiers(tmp_path):
    opt, model = objects()
    with pytest.warns(DeprecationWarning, match=r"tiers=lowdiff.Tiers\("):
        wrapped = lowdiff.wrap(opt, model, tmp_path / "local", shared_dir=tmp_path / "shared")
    with wrapped:
        assert wrapped.config.tiers == lowdiff.Tiers(tmp_path / "shared")
        train(wrapped, model, 2)
    assert take_inventory(str(tmp_path / "shared")).manifest.fulls


def test_old_engine_still_chooses_the_engine(tmp_path):
    engine = fastio.make_engine(fastio.FastioConfig(backend="pwrite"))
    try:
        opt, model = objects()
        with pytest.warns(DeprecationWarning, match="FASTIO_BACKEND"):
            wrapped = lowdiff.wrap(opt, model, tmp_path / "ckpt", engine=engine)
        with wrapped:
            assert wrapped._fulls._engine is engine and wrapped._session.diffs._engine is engine
            train(wrapped, model, 2)
    finally:
        engine.close()


def test_the_contract_spelling_does_not_warn(tmp_path):
    """DESIGN.md's public contract (pytest turns any warning into an error here)."""
    opt, model = objects()
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    with lowdiff.wrap(opt, model, tmp_path / "ckpt", compressor=lowdiff.TopK(ratio=0.5), full_every="auto",
                      batch_steps=2, scheduler=sched, extra_state={"sched": sched}) as wrapped:
        train(wrapped, model, 3)


@pytest.mark.parametrize("policy,fulls", [(lowdiff.KeepLast(2), [8, 10]), (lowdiff.KeepAll(), [0, 2, 4, 6, 8, 10]),
                                          (lowdiff.KeepEvery(4, last=1), [4, 8, 10])])
def test_the_main_directory_keeps_what_its_policy_says(tmp_path, policy, fulls):
    opt, model = objects()
    with lowdiff.wrap(opt, model, tmp_path / "ckpt", full_every=2, batch_steps=1, retention=policy) as wrapped:
        train(wrapped, model, 10)
    manifest = take_inventory(str(tmp_path / "ckpt")).manifest
    assert sorted(f.step for f in manifest.fulls) == fulls
    assert sorted(n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".ldf")) == \
        sorted(f.file for f in manifest.fulls)
