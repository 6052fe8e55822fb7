"""A trainer the kill campaigns SIGKILL (not a test module): ``python killed_trainer.py DIR
SETTINGS STEPS OUT``. Resumes DIR, trains to STEPS (lowdiff_helpers' tiny model) and after each
step appends "STEP DURABLE DIGEST" to OUT (DURABLE: the step ``durable_step`` reports then), after
the resume "resumed STEP DIGEST". SETTINGS: "auto" (full_every="auto", batch_steps="auto" and
differentials="auto", at a failure rate that makes the controller decide within a few steps),
"keywords" (``full_every="auto", batch_steps="auto"``) or "fixed"."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "integration"))

import torch  # noqa: E402
from lowdiff_helpers import build, train_steps, wrap  # noqa: E402

import lowdiff  # noqa: E402
import recovery  # noqa: E402
from lowdiff.cli.demo import state_digest  # noqa: E402

SETTINGS = {"auto": {"schedule": lowdiff.Auto(differentials="auto", failure_rate_per_hour=3.6e5)},
            "keywords": {"full_every": "auto", "batch_steps": "auto"},
            "fixed": {}}


def main(directory: str, settings: str, steps: int, out_path: str) -> None:
    torch.set_num_threads(1)
    model, opt, sched, sampler = build()
    opt = wrap(directory, model, opt, sched, sampler, **SETTINGS[settings])
    start = int(recovery.resume(directory, model, opt))
    with open(out_path, "a") as out:
        out.write(f"resumed {start} {state_digest(model, opt, sched, sampler)}\n")
        out.flush()

        def report(step):
            out.write(f"{step} {opt.durable_step} {state_digest(model, opt, sched, sampler)}\n")
            out.flush()
        train_steps(model, opt, sched, sampler, start, steps, report)
    opt.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
