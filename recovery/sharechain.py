"""The differentials of a partitioned directory as one chain: each step's record is the union of
the shares' records of that step (each gradient from the share that owns its parameter), served to
``recovery.replay`` through the same interface as an open batch file.

The share files arrive as bytes in memory (read by one rank each and sent to the others, see
recovery.distributed), so every rank decodes exactly the same bytes and stops at the same step.
"""
from __future__ import annotations

import dataclasses

from lowdiff.errors import CorruptCheckpointError
from lowdiff.manifest import BatchEntry
from lowdiff.records import StepRecord, decode_record
from lowdiff.sharefile import parse_diff_share


@dataclasses.dataclass(frozen=True)
class ShareFiles:
    """The differential files of share ``index`` continuing a full set, as (name, bytes), in order."""
    index: int
    files: tuple


def _share_steps(share: ShareFiles, first: int, warn) -> tuple[dict, tuple | None]:
    """{step: (path, offset, bytes view)} of one share's records from ``first`` on, contiguous,
    and the slots it owns (None when it holds no file). A file whose index does not verify ends
    the share's chain before it (with a warning)."""
    steps: dict = {}
    slots = None
    expected = first
    for name, data in share.files:
        try:
            index = parse_diff_share(name, data)
        except CorruptCheckpointError as exc:
            warn(f"lowdiff: {exc}; the chain of share {share.index} ends at step {expected - 1}")
            break
        if index.index != share.index or (slots is not None and index.slots != slots):
            warn(f"lowdiff: {name} is share {index.index} owning other parameters, not share {share.index}; "
                 f"the chain of share {share.index} ends at step {expected - 1}")
            break
        slots = index.slots
        view = memoryview(data)
        for step, offset, nbytes in index.batch.records:
            if step != expected:
                if step > expected:
                    return steps, slots
                continue
            steps[step] = (name, offset, view[offset:offset + nbytes])
            expected += 1
    return steps, slots


class MergedShares:
    """Looks like an open ``BatchReader`` to ``recovery.replay`` (``path``, ``index_error``,
    ``entries``, ``steps``, ``read_for_replay``, ``decode_record``)."""

    def __init__(self, root: str, shares: list, base_step: int, param_count: int, own: int | None, warn):
        self.path = root
        self.index_error = None
        self._own = own          # the share whose per-rank objects this rank takes (None: a new rank)
        self._param_count = param_count
        per_share = [_share_steps(share, base_step + 1, warn) for share in shares]
        self._records = [steps for steps, _ in per_share]
        self._owner = self._owners([slots for _, slots in per_share], param_count)
        last = base_step
        while self._owner is not None and all(last + 1 in steps for steps in self._records):
            last += 1
        self.steps = list(range(base_step + 1, last + 1))
        self.entries = [(step, 0, 0) for step in self.steps]

    def _owners(self, slots_per_share: list, param_count: int) -> list | None:
        """Which share owns each parameter, checked to be exactly one each (None: shares without
        files, nothing to replay)."""
        if any(slots is None for slots in slots_per_share):
            return None
        owner = [-1] * param_count
        for share, slots in enumerate(slots_per_share):
            for slot in slots:
                if slot >= param_count or owner[slot] != -1:
                    raise CorruptCheckpointError(self.path, f"differential shares claim parameter {slot} twice or "
                                                            f"beyond the {param_count} parameters")
                owner[slot] = share
        if -1 in owner:
            raise CorruptCheckpointError(self.path, f"no differential share holds parameter {owner.index(-1)}")
        return owner

    def entry(self) -> BatchEntry:
        """A manifest-like entry of the whole merged chain (replay reads ``last``)."""
        first = self.steps[0] if self.steps else 0
        return BatchEntry(first, self.steps[-1] if self.steps else first, self.path, 0, "")

    def read_record_bytes(self, position: int) -> list:
        step = self.steps[position]
        return [records[step] for records in self._records]

    def read_for_replay(self, position: int, memory) -> tuple:
        """As BatchReader's: the shares' records are in memory already (no buffer of ``memory``)."""
        return self.read_record_bytes(position), None

    def decode_record(self, position: int, data: list, *, owned: bool = False) -> StepRecord:
        """Verify every share's record of the step and join them (see the module doc). The values
        are views of the shares' bytes (``owned`` is not needed): the files' memory is this chain's
        own (recovery.distributed reads or receives it for the replay) and replay decodes each
        step once, so each record's bytes are handed over to its decoding for good."""
        step = self.steps[position]
        records = [decode_record(view, name, offset, expected_step=step, owned=True) for name, offset, view in data]
        assert self._owner is not None  # steps is empty otherwise
        first = records[0]
        if any(r.skipped != first.skipped for r in records):
            raise CorruptCheckpointError(self.path, f"the shares of step {step} disagree on whether it was skipped")
        grads: list = []
        if not first.skipped:
            if any(len(r.grads) != self._param_count for r in records):
                raise CorruptCheckpointError(self.path, f"a share of step {step} does not list every parameter")
            grads = [records[share].grads[slot] for slot, share in enumerate(self._owner)]
        if self._own is not None:
            objects = records[self._own].objects
        else:  # a rank that did not exist: share 0's replicated objects, no RNG or extra state
            objects = {**records[0].objects, "rng": {}, "extra": {}}
        return StepRecord(step, first.skipped, grads, objects)

    def close(self) -> None:
        self._records = []
