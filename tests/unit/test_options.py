"""wrap()'s option objects: each refuses, in its constructor, what cannot work (naming the field and
the value); wrap_config resolves them (and the short full_every/batch_steps spelling) into the one
WrapConfig, and refuses two spellings of one setting."""
import pytest
import torch

import lowdiff
from lowdiff.train.config import WrapConfig
from lowdiff.train.options import wrap_config


@pytest.mark.parametrize("build,match", [
    (lambda: lowdiff.Fixed(full_every=0), r"Fixed\(full_every=0\): full_every must be an int >= 1"),
    (lambda: lowdiff.Fixed(full_every=True), r"Fixed\(full_every=True\)"),
    (lambda: lowdiff.Fixed(batch_steps="auto"), r"Fixed\(batch_steps='auto'\)"),
    (lambda: lowdiff.Fixed(differentials="auto"), r"Fixed\(differentials='auto'\).*lowdiff.Auto"),
    (lambda: lowdiff.Auto(full_every=50, batch_steps=5), r"chooses nothing.*lowdiff.Fixed"),
    (lambda: lowdiff.Auto(full_every=50, batch_steps=5, differentials=False), r"chooses nothing"),
    (lambda: lowdiff.Auto(full_every=0), r"Auto\(full_every=0\)"),
    (lambda: lowdiff.Auto(batch_steps="never"), r"Auto\(batch_steps='never'\)"),
    (lambda: lowdiff.Auto(differentials="sometimes"), r"Auto\(differentials='sometimes'\)"),
    (lambda: lowdiff.Auto(failure_rate_per_hour=0.0), r"Auto\(failure_rate_per_hour=0.0\)"),
    (lambda: lowdiff.Auto(max_recovery_s=-1.0), r"Auto\(max_recovery_s=-1.0\)"),
    (lambda: lowdiff.Auto(batch_memory_bytes=0), r"Auto\(batch_memory_bytes=0\)"),
    (lambda: lowdiff.Replica(full_every="auto"), r"Replica\(full_every='auto'\).*not supported in replica mode"),
    (lambda: lowdiff.Replica(inflight_steps=0), r"Replica\(inflight_steps=0\)"),
    (lambda: lowdiff.Replica(batch_steps=0), r"Replica\(batch_steps=0\)"),
    (lambda: lowdiff.Options(boundary="later"), r"Options\(boundary='later'\)"),
    (lambda: lowdiff.Options(max_pending_batches=0), r"Options\(max_pending_batches=0\)"),
    (lambda: lowdiff.KeepLast(0), r"KeepLast\(n=0\)"),
])
def test_an_impossible_setting_is_refused_by_its_constructor(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_options_overwrite_must_be_a_bool():
    with pytest.raises(ValueError, match=r"Options\(overwrite='yes'\)"):
        lowdiff.Options(overwrite="yes")


def test_the_objects_are_frozen():
    with pytest.raises(AttributeError):
        lowdiff.Fixed().full_every = 5   # type: ignore[misc]


def test_the_short_spelling_is_a_fixed_or_an_automatic_schedule():
    assert wrap_config(None, None, None, None, None, None) == WrapConfig()
    assert wrap_config(50, 5, None, None, None, None) == \
        wrap_config(None, None, lowdiff.Fixed(full_every=50, batch_steps=5), None, None, None)
    assert wrap_config("auto", None, None, None, None, None) == \
        wrap_config(None, None, lowdiff.Auto(full_every="auto", batch_steps=10), None, None, None)
    config = wrap_config(None, None, lowdiff.Auto(differentials="auto", failure_rate_per_hour=2.0, max_recovery_s=9.0,
                                                  batch_memory_bytes=2**20), lowdiff.KeepEvery(10), None,
                         lowdiff.Options(boundary="manual", max_pending_batches=3, overwrite=True))
    assert config == WrapConfig(full_every="auto", batch_steps="auto", differentials="auto", failure_rate_per_hour=2.0,
                                max_recovery_s=9.0, batch_memory_bytes=2**20, retention=lowdiff.KeepEvery(10),
                                boundary="manual", max_pending_batches=3, overwrite=True)
    replica = wrap_config(None, None, lowdiff.Replica(full_every=4, batch_steps=2, inflight_steps=3), None, None, None)
    assert replica == WrapConfig(full_every=4, batch_steps=2, replica=True, replica_inflight_steps=3)
    with pytest.raises(ValueError, match="full_every=0 must be a positive int or 'auto'"):
        wrap_config(0, None, None, None, None, None)


@pytest.mark.parametrize("arguments,error,match", [
    ({"full_every": 50, "schedule": lowdiff.Fixed()}, ValueError, r"full_every=50 and schedule=.*not both"),
    ({"batch_steps": "auto", "schedule": lowdiff.Auto()}, ValueError, r"batch_steps='auto' and schedule="),
    ({"schedule": "auto"}, TypeError, "schedule must be lowdiff.Fixed"),
    ({"retention": 3}, TypeError, "retention must be lowdiff.KeepLast"),
    ({"tiers": "/shared"}, TypeError, "tiers must be lowdiff.Tiers"),
    ({"options": {"boundary": "manual"}}, TypeError, "options must be lowdiff.Options"),
    ({"retention": lowdiff.KeepLast(3), "tiers": lowdiff.Tiers("/shared", local=lowdiff.KeepAll())}, ValueError,
     "both name the policy of the local directory"),
])
def test_two_spellings_of_one_setting_or_a_wrong_object_are_refused(arguments, error, match):
    given = {"full_every": None, "batch_steps": None, "schedule": None, "retention": None, "tiers": None,
             "options": None, **arguments}
    with pytest.raises(error, match=match):
        wrap_config(**given)


def test_the_local_tier_policy_may_be_given_either_way():
    tiers = lowdiff.Tiers("/shared", local=lowdiff.KeepLast(3))
    assert wrap_config(None, None, None, lowdiff.KeepLast(3), tiers, None).tiers == tiers
    assert wrap_config(None, None, None, None, tiers, None).tiers.local_policy(lowdiff.KeepLast(2)) == \
        lowdiff.KeepLast(3)


def _objects():
    model = torch.nn.Linear(4, 2)
    return torch.optim.SGD(model.parameters(), lr=0.1), model


@pytest.mark.parametrize("old,error,match", [
    ({"keep_full": 3, "retention": lowdiff.KeepLast(3)}, ValueError, r"wrap\(keep_full=...\) and retention="),
    ({"boundary": "manual", "options": lowdiff.Options()}, ValueError, r"wrap\(boundary=...\) and options="),
    ({"differentials": False, "schedule": lowdiff.Fixed()}, ValueError, r"wrap\(differentials=...\) and schedule="),
    ({"replica": True, "differentials": False}, ValueError, "not supported with replica=True"),
    ({"shared_dir": "/a", "tiers": lowdiff.Tiers("/b")}, ValueError, "differs from tiers.shared_dir"),
    ({"no_such_option": 1}, TypeError, "unexpected keyword argument 'no_such_option'"),
])
def test_an_old_keyword_that_contradicts_the_new_spelling_is_refused(tmp_path, old, error, match):
    """(Refused before any warning: pytest turns a warning into an error here.)"""
    opt, model = _objects()
    with pytest.raises(error, match=match):
        lowdiff.wrap(opt, model, tmp_path / "ckpt", **old)
    assert not (tmp_path / "ckpt").exists()   # refused before anything is written
