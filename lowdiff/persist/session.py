"""lowdiff.persist.session: the checkpoint session of one wrapped optimizer — its directory (the store),
the background writers of differential batches and full checkpoints, the controller that sets
their pace, when full checkpoints are taken, and durability (flush, close, sticky write errors).

It never looks at the training objects: the step's record and the full checkpoint's state are
built by lowdiff.capture.stepcapture and handed over here.
"""
from __future__ import annotations

from collections.abc import Callable

from lowdiff.control.controller import Controller
from lowdiff.distributed.shareretention import DroppedRanks
from lowdiff.errors import CheckpointError
from lowdiff.format.schema import TrainedWith
from lowdiff.persist.background import DiffWriter, FullWriter
from lowdiff.store.directory import CheckpointStore
from lowdiff.tiers.drainer import open_tiers


class CheckpointSession:
    """Writers, store and controller of one run, used from the training thread in this order:

    * each step: ``check_writers`` before anything changes; ``take_base`` at the first step (after
      ``check_can_start``); ``fulls.release()`` before the optimizer changes the state;
      ``diffs.put(record)``; then ``full_checkpoint_due`` -> ``take_full`` or ``prepare_staging``;
      on failure, ``step_failed``.
    * ``flush`` at will; ``close_writers`` then ``close_store`` once, at the end.

    A failed background write is sticky: ``check_writers``, ``flush`` and ``close_writers`` raise
    it, with its original type, on every call until the session is closed (and after).
    """

    def __init__(self, directory, config, engine=None, partition=None):
        """``partition`` (lowdiff.distributed.partition.Partition): write this rank's shares into its rank
        directory of ``directory`` instead of whole checkpoints into ``directory``."""
        self.config = config
        self.controller = Controller(config)
        self.drainer = None          # storage tiers: copies committed files to the shared tier
        # Partitioned, the drives hold whole rank directories (placed at wrap, lowdiff.distributed.drives),
        # and a rank with several share drives stripes over its stripe directories on the others.
        stripe_dirs = config.stripe_dirs if partition is None else partition.stripe_dirs
        if config.tiers is not None:
            # (Partitioned: each rank drains its own rank directory; the join happens in there.)
            self.store, self.drainer = open_tiers(directory, config.tiers, config.retention, engine, partition,
                                                  stripe_dirs=stripe_dirs)
        elif partition is None:
            self.store = CheckpointStore(directory, config.retention, stripe_dirs=stripe_dirs)
        else:
            self.store = CheckpointStore(partition.directory, config.retention, complete=partition.complete,
                                         stripe_dirs=stripe_dirs)
            partition.join(self.store)
        self.partition = partition
        self.dropped = None          # partitioned: rank directories of ranks that no longer exist
        if partition is not None:
            self.store.shares_durable = partition.durable_step
            try:
                self.dropped = DroppedRanks(partition)
            except BaseException:
                self.close_store()
                raise
            self.dropped.attach(self.store)
        self.directory = self.store.directory
        # Replica mode: a persisted replica holds the steps before it, their records need no batch.
        self.diffs = DiffWriter(self.store, self.controller, config.max_pending_batches, engine,
                                batch_format=partition, drop_covered=config.replica)
        self.fulls = FullWriter(self.store, self.controller, engine,
                                background_copy=config.full_copy == "background",
                                snapshot=None if partition is None else partition.snapshot())
        self.controller.load_state(self.directory)   # measurements of earlier sessions (CONTROLLER.json)
        self.recording = self.controller.differentials   # differentials in force (see begin_step)
        self._switch_on = False           # differentials start again after the next full checkpoint
        self._unrecorded: tuple | None = None   # (step, boundary objects) of the newest step not recorded
        self.closed = False
        self.base_taken = False
        self._resumed = False
        self._last_full_step = 0
        self._full_due = False            # take a full checkpoint at the end of this step
        self.fulls_deferred = 0           # steps a due full checkpoint was put off (busy writer)
        self._staging_prepared = False

    # ------------------------------------------------------------ scheduling full checkpoints
    def mark_resumed(self) -> None:
        """The run continues from a restored step: the directory's later steps may be overwritten.
        Only before the base checkpoint (the first step)."""
        if self.base_taken:
            raise CheckpointError("resume must happen before the first step() of a lowdiff optimizer")
        self._resumed = True

    def check_can_start(self, step: int) -> None:
        """Refuse to start recording after ``step`` over a directory that holds later steps, unless
        this run resumed from it or was wrapped with overwrite=True."""
        latest = self.store.latest_step()
        if not self._resumed and latest > step and not self.config.overwrite:
            raise CheckpointError(
                f"{self.directory} already holds checkpoints up to step {latest}; call "
                f"recovery.resume(directory, model, optimizer) before training, or wrap(..., overwrite=True)")

    def force_full(self) -> None:
        """Take a full checkpoint at the end of the current step (or of the next one, if this
        one has passed that point), whatever ``full_every`` says."""
        self._full_due = True

    def full_checkpoint_due(self, step: int) -> bool:
        """Whether a full checkpoint ends ``step``: forced, or ``full_every`` steps since the last
        one. A forced one counts as taken once this has said so.

        With the controller choosing ``full_every`` (Auto), one that falls due while the previous
        is still being written is put off to the first step after that write ends: the
        differentials hold every step meanwhile, so nothing is at risk, and waiting would stall
        training for the disk (staging is reused). A fixed ``full_every`` is kept as given."""
        if self._full_due:
            self._full_due = False
            return True
        if step - self._last_full_step < self.controller.full_every:
            return False
        if self.controller.auto_full and self.recording and self.fulls.busy():
            self.fulls_deferred += 1
            return False
        return True

    def begin_step(self) -> bool:
        """Before the optimizer step: whether this step records a differential. They stop at once
        when the controller says so (the open batch is sealed: the steps before stay replayable),
        and start again only after a full checkpoint — the step that sees the change takes one at
        its end, and the next step records the first differential after it."""
        wanted = self.controller.differentials
        if wanted and not self.recording:
            self._full_due = self._switch_on = True
        elif not wanted and self.recording:
            self.recording = False
            self.diffs.seal()
        return self.recording

    def hold_unrecorded(self, step: int, objects: dict) -> None:
        """Without differentials: the boundary objects of ``step``, for ``save_unrecorded``."""
        self._unrecorded = (step, objects)

    def save_unrecorded(self, full_checkpoint: Callable[[dict], tuple[dict, TrainedWith]]) -> None:
        """Without differentials the steps after the last full checkpoint are only in memory (flush
        and close must make them durable): take a full checkpoint of the newest one now, with
        ``full_checkpoint(objects)`` (lowdiff.capture.stepcapture) building its state."""
        if self._unrecorded is not None and self._unrecorded[0] > self._last_full_step:
            step, objects = self._unrecorded
            self._unrecorded = None
            self.take_full(step, *full_checkpoint(objects), base=False)

    def take_full(self, step: int, state: dict, meta: TrainedWith, base: bool) -> None:
        """Persist ``state`` (see lowdiff.capture.stepcapture) as the full checkpoint of ``step`` in the
        background; ``base`` for the first one of this run."""
        self._last_full_step = step
        if self._switch_on:
            self.recording, self._switch_on = True, False
        self.fulls.take(step, state, meta, base)
        # Close the batch ending at this step, so the chain from the previous full checkpoint
        # reaches it (queued before any later record).
        self.diffs.seal()
        if base:
            self.base_taken = True

    def prepare_staging(self, payload_bytes) -> None:
        """Once, after the first step that took no full checkpoint: optimizer state exists then
        (Adam creates it lazily), so size staging for it off-thread. ``payload_bytes()`` says how much."""
        if not self._staging_prepared:
            self._staging_prepared = True
            self.fulls.prepare(payload_bytes())

    def step_failed(self, recorded: bool) -> None:
        """A step failed after the optimizer changed the state. The state moved past what the
        records hold: end the batch before the gap (unless the step's record was queued), and take
        a full checkpoint at the end of the next step so that resuming is exact from there."""
        self._full_due = True
        if not recorded:
            self.diffs.seal()

    # ------------------------------------------------------------ durability
    def check_writers(self) -> None:
        """Re-raise a background write error (sticky: until this optimizer is closed)."""
        self.diffs.check()
        self.fulls.check()
        if self.drainer is not None:
            self.drainer.check()

    def wait_for_shared(self) -> None:
        """Before a step: block while the shared tier is too far behind (lowdiff.tiers.drainer)."""
        if self.drainer is not None:
            self.drainer.throttle()

    def durable_step(self) -> int:
        """The newest step that is on disk and can be resumed (-1 before the first commit)."""
        return self.store.durable_step()

    def shared_durable_step(self) -> int | None:
        """With storage tiers, the shared tier's durable step (Drainer.durable_step); else None."""
        return None if self.drainer is None else self.drainer.durable_step()

    def flush(self) -> None:
        """Block until every recorded step (and any full checkpoint in progress) is durable.
        Raises the error of a failed background write (every time: checkpointing has stopped)."""
        if self.closed:
            self.check_writers()
            return
        self.diffs.flush()
        self.fulls.wait()
        self.check_writers()

    def close_writers(self) -> None:
        """Write what is pending, stop the background threads, raise a failed write's error.
        ``close_store`` must follow, whatever this raises."""
        try:
            self.diffs.close()
        finally:
            self.fulls.close()
        self.controller.save_state()   # what this session measured since its last full checkpoint
        self.check_writers()
        if self.drainer is not None:
            self.drainer.close()   # everything committed locally reaches the shared tier

    def close_store(self) -> None:
        """Release the directory (its lock). Ends the session."""
        self.closed = True
        try:
            if self.drainer is not None:
                self.drainer.stop()
        finally:
            self.store.close()
            if self.dropped is not None:
                self.dropped.close()

    def stats(self, step: int, outside_changes: int) -> dict:
        """See LowDiffOptimizer.stats."""
        out = {"step": step, "full_every": self.controller.full_every,
               "batch_steps": self.controller.batch_steps, "differentials": self.recording,
               "background_copy": self.fulls.background_copy,
               "outside_changes": outside_changes, "fulls_deferred": self.fulls_deferred,
               **self.controller.stats()}
        if self.drainer is not None:
            out["tiers"] = self.drainer.snapshot()
        # What a resume reaches now; partitioned: every share of a complete set, and this rank's own.
        out["durable_step"] = self.durable_step()
        if self.partition is not None:
            out["rank_durable_step"] = self.store.manifest.durable_step()
        return out
