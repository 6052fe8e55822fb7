"""Progress of long recoveries: quiet for short ones, log lines when not on a terminal."""
import logging

from recovery.pipeline.progress import Progress


def test_short_recoveries_say_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="lowdiff"):
        progress = Progress(10, "replaying", after_s=60)
        for _ in range(10):
            progress.update()
        progress.close()
    assert not caplog.records


def test_long_recoveries_log_progress_when_not_on_a_terminal(caplog):
    with caplog.at_level(logging.INFO, logger="lowdiff"):
        progress = Progress(3, "replaying", after_s=0, every_s=0)
        for _ in range(3):
            progress.update()
        progress.close()
    messages = [r.getMessage() for r in caplog.records]
    assert messages[-1].startswith("lowdiff: replaying: 3 of 3 steps"), messages
