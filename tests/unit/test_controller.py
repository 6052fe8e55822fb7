"""The controller's decisions follow its cost model; fixed settings are left alone."""
import math

import pytest

from lowdiff.config import WrapConfig
from lowdiff.controller import MAX_BATCH_STEPS, Controller


def feed(controller, step_s, optimizer_s, stall_s, persist_s, batch_write_s, batch_steps):
    controller.step_s.add(step_s)
    controller.optimizer_step_s.add(optimizer_s)
    controller.stall_s.add(stall_s)
    controller.full_persisted(persist_s)
    controller.batch_written(batch_steps, batch_write_s)


def test_fixed_settings_are_kept():
    controller = Controller(WrapConfig(full_every=7, batch_steps=3))
    feed(controller, 0.1, 0.01, 1.0, 5.0, 0.5, 3)
    assert (controller.full_every, controller.batch_steps) == (7, 3)


def test_auto_full_every_is_the_optimum_of_the_cost_model():
    controller = Controller(WrapConfig(full_every="auto", batch_steps=4, failure_rate_per_hour=1.0))
    feed(controller, step_s=0.1, optimizer_s=0.01, stall_s=0.05, persist_s=0.5, batch_write_s=0.01, batch_steps=4)
    expected = math.sqrt(2 * 0.05 / (0.1 * (1.0 / 3600) * 0.01))
    assert controller.full_every == int(expected)


def test_auto_full_every_never_below_persist_time():
    controller = Controller(WrapConfig(full_every="auto", batch_steps=4, failure_rate_per_hour=1e6))
    feed(controller, step_s=0.1, optimizer_s=0.01, stall_s=0.05, persist_s=3.0, batch_write_s=0.01, batch_steps=4)
    assert controller.full_every >= 30


@pytest.mark.parametrize("write_s,expected", [(0.001, 1), (0.5, 10), (100.0, MAX_BATCH_STEPS)])
def test_auto_batch_steps_keeps_the_writer_under_half_busy(write_s, expected):
    controller = Controller(WrapConfig(full_every=10, batch_steps="auto"))
    controller.batch_steps = 1
    feed(controller, step_s=0.1, optimizer_s=0.01, stall_s=0.05, persist_s=0.1, batch_write_s=write_s, batch_steps=1)
    assert controller.batch_steps == expected


@pytest.mark.parametrize("field,value", [("full_every", 0), ("batch_steps", "never"), ("keep_full", 0),
                                         ("failure_rate_per_hour", 0.0), ("full_every", True)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        WrapConfig(**{field: value})
