"""Named fault points: where a test may SIGKILL the process to prove that a crash at that point
loses nothing durable.

``LOWDIFF_FAULT=PHASE:N`` (read once, at import) kills the process with SIGKILL the N-th time it
reaches ``point(PHASE)`` (N counts from 1). Phases, in the order a checkpoint goes to disk:

``record``          a step was recorded (handed to the background writer), nothing written yet
``batch-write``     a differential batch's records are written, its index and commit are not
``batch-commit``    a batch file is committed under its name; the manifest does not list it yet
``full-write``      a full checkpoint's payload is written, its index and commit are not
``full-commit``     a full checkpoint is committed under its name; the manifest does not list it yet
``manifest-write``  a new manifest is written and synced under its temporary name, not yet replaced
``manifest-commit`` the new manifest replaced the old one; files it dropped are not yet deleted
``retention``       between two deletions of files the committed manifest dropped (a striped full
                    checkpoint's stripes, deleted before its file, count one each)

With storage tiers (lowdiff.tiers.policy), the drainer copying committed files to the shared tier:

``drain-write``     a file's copy is written and synced under its temporary name in the shared tier
``drain-commit``    the copy is committed under its name; the shared manifest does not list it yet
``clean``           between two deletions of files the shared tier's committed manifest dropped

With ``full_every``/``batch_steps`` "auto" (lowdiff.control.controlstate):

``controller-write`` a new CONTROLLER.json is written and synced under its temporary name, not yet replaced

In a partitioned directory resumed with fewer ranks (lowdiff.distributed.shareretention):

``dropped-clean``   between two deletions of a dropped rank's files its committed manifest dropped
``dropped-prefix``  between two deletions of a dropped rank's prefix in a bucket (lowdiff.tiers.bucket)

With full checkpoints striped over several devices (lowdiff.store.stripes):

``stripe-write``    a stripe is committed under its name on its device; the checkpoint file naming the
                    stripes and the manifest are not

Without the variable ``point`` is a dictionary lookup; nothing else changes.
"""
from __future__ import annotations

import os
import signal
import threading

PHASES = ("record", "batch-write", "batch-commit", "full-write", "full-commit", "manifest-write",
          "manifest-commit", "retention")
# Reached only with a shared tier (lowdiff.tiers.drainer): kept apart so that a single-directory run's
# list of phases (which tests crash at, one by one) stays as it is.
TIER_PHASES = ("drain-write", "drain-commit", "clean")
PARTITION_PHASES = ("dropped-clean", "dropped-prefix")
CONTROL_PHASES = ("controller-write",)
STRIPE_PHASES = ("stripe-write",)


def _parse(spec: str | None) -> tuple[str, int] | None:
    known = PHASES + TIER_PHASES + PARTITION_PHASES + CONTROL_PHASES + STRIPE_PHASES
    if not spec:
        return None
    phase, _, count = spec.partition(":")
    if phase not in known or not count.isdigit() or int(count) < 1:
        raise ValueError(f"LOWDIFF_FAULT={spec!r}: expected PHASE:N with PHASE one of "
                         f"{', '.join(known)} and N >= 1")
    return phase, int(count)


_plan = _parse(os.environ.get("LOWDIFF_FAULT"))
_reached: dict = {}
_lock = threading.Lock()


def point(phase: str) -> None:
    """Reached ``phase``: SIGKILL this process if the fault plan says so."""
    if _plan is None or _plan[0] != phase:
        return
    with _lock:
        _reached[phase] = _reached.get(phase, 0) + 1
        if _reached[phase] == _plan[1]:
            os.kill(os.getpid(), signal.SIGKILL)
