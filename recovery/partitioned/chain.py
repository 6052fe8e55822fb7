"""The differentials of a partitioned directory as one chain: each step's record is the union of
the shares' records of that step (each gradient from the share that owns its parameter), served to
``recovery.pipeline.replay`` through the same interface as an open batch file.

The files' indexes are known up front (which steps each file holds, at which offsets); their bytes
arrive one file at a time as the replay reaches them (``fetch``: read by one rank and sent to the
others, see recovery.partitioned.restore), so a rank holds the files of the records in flight, not the
whole chain, and every rank decodes exactly the same bytes and stops at the same step.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from lowdiff.distributed import dtensors
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format.records import Compressed, StepRecord, decode_record
from lowdiff.format.sharefile import DiffShareIndex
from lowdiff.step.compress import decompress_into
from lowdiff.store.manifest import BatchEntry

_ASSEMBLE = -2   # an owner: the gradient is cut from every share's chunk (resharding)


@dataclasses.dataclass(frozen=True)
class ShareFiles:
    """The differential files of share ``index`` continuing a full set, in order: (path, its
    DiffShareIndex, or why it could not be read: the chain of the share ends there)."""
    index: int
    files: tuple


# fetch(share, file position) -> the file's bytes (a writable uint8 array) or None when they could
# not be read; called in the same order on every rank (recovery.partitioned.restore makes it a collective).
Fetch = Callable[[int, int], object]


def _share_steps(share: ShareFiles, first: int, warn) -> tuple[dict, tuple | None]:
    """{step: (file position, offset, bytes)} of one share's records from ``first`` on, contiguous,
    and the slots it owns (None when it holds no file), those whose gradients are DTensor chunks
    (every share holds its own of those) marked by a negative entry ``-1 - slot``. A file whose
    index does not verify ends the share's chain before it (with a warning)."""
    steps: dict = {}
    slots = None
    chunks = None
    expected = first
    for position, (name, index) in enumerate(share.files):
        if not isinstance(index, DiffShareIndex):
            warn(f"lowdiff: {index}; the chain of share {share.index} ends at step {expected - 1}")
            break
        marked = tuple(-1 - slot if slot in index.dtensors else slot for slot in index.slots)
        if index.index != share.index or (slots is not None and marked != slots):
            warn(f"lowdiff: {name} is share {index.index} owning other parameters, not share {share.index}; "
                 f"the chain of share {share.index} ends at step {expected - 1}")
            break
        # The chunks (and, HSDP, which share records which) are those of the chain's first file: one
        # session, one mesh. A file that says otherwise is not replayed as if it agreed.
        if chunks is not None and (index.dtensors, index.elsewhere) != chunks:
            warn(f"lowdiff: {name} names other DTensor chunks than the files of share {share.index} before it; "
                 f"the chain of share {share.index} ends at step {expected - 1}")
            break
        slots, chunks = marked, (index.dtensors, index.elsewhere)
        for step, offset, nbytes in index.batch.records:
            if step != expected:
                if step > expected:
                    return steps, slots
                continue
            steps[step] = (position, offset, nbytes)
            expected += 1
    return steps, slots


def chain_reach(shares: list, base_step: int, warn) -> int:
    """The step the shares' files continue ``base_step`` to by their indexes (no record read):
    the last step every share holds contiguously (``base_step`` when a share holds no file).
    What ``MergedShares`` replays at most; recovery plans a target step with it."""
    per_share = [_share_steps(share, base_step + 1, warn) for share in shares]
    last = base_step
    while per_share and all(slots is not None for _, slots in per_share) and \
            all(last + 1 in steps for steps, _ in per_share):
        last += 1
    return last


def _check_holders(firsts: list) -> None:
    """HSDP ("2-D meshes"): every gradient chunk a share names another share for (`elsewhere`) is
    recorded by that share, with the same chunk entry. Else the chunk would be cut from chunks that
    do not tile it (a wrong gradient, silently): the differentials are not replayed (raises).
    ``firsts``: (path, DiffShareIndex) of each share's first file, or (None, None)."""
    for share, (path, index) in enumerate(firsts):
        for slot, holder in (index.elsewhere.items() if index is not None else ()):
            held_path, held = firsts[holder] if holder < len(firsts) else (None, None)
            if held is None:
                continue   # that share holds no file: nothing is replayed (MergedShares._owners)
            lacking = dtensors.lacks_gradient_chunk(index, held, slot)
            if lacking:
                raise CorruptCheckpointError(str(held_path), f"share {holder} is named by share {share} ({path}) "
                                                             f"for chunks it does not hold: it has {lacking}")


class MergedShares:
    """Looks like an open ``BatchReader`` to ``recovery.pipeline.replay`` (``path``, ``index_error``,
    ``entries``, ``steps``, ``prepare_read``, ``read_for_replay``, ``decode_record``)."""

    def __init__(self, root: str, shares: list, base_step: int, param_count: int, own: int | None, warn,
                 fetch: Fetch, live_chunks: dict | None = None, own_chunks: bool = False):
        """``live_chunks``: {slot: live DTensor parameter}; a recorded DTensor gradient whose chunks
        are not this rank's chunks of it (another world size or mesh), or whose parameter is not a
        DTensor here (export, an unsharded model: the whole gradient), is cut from every share's.
        ``own_chunks`` (a sharded export, a share at a time): every DTensor gradient is share
        ``own``'s recorded chunk, as its optimizer consumed it."""
        self.path = root
        self._live = live_chunks or {}
        self._own_chunks = own_chunks
        firsts = [next(((path, index) for path, index in share.files if isinstance(index, DiffShareIndex)),
                       (None, None)) for share in shares]
        _check_holders(firsts)
        first_indexes = [index for _, index in firsts]
        self._chunks = [index.dtensors if index is not None else {} for index in first_indexes]
        # {slot: share recording it instead} of each share (HSDP: one rank of a replicate group records a chunk)
        self._elsewhere = [index.elsewhere if index is not None else {} for index in first_indexes]
        self.index_error = None
        self._own = own          # the share whose per-rank objects this rank takes (None: a new rank)
        self._param_count = param_count
        self._shares = shares
        self._fetch = fetch
        per_share = [_share_steps(share, base_step + 1, warn) for share in shares]
        self._records = [steps for steps, _ in per_share]
        self._owner = self._owners([slots for _, slots in per_share], param_count)
        last = base_step
        while self._owner is not None and all(last + 1 in steps for steps in self._records):
            last += 1
        self.steps = list(range(base_step + 1, last + 1))
        self.entries = [(step, 0, 0) for step in self.steps]
        self._held: list = [(-1, None)] * len(shares)   # per share: (file position, its bytes) fetched last
        self._ready: dict = {}                           # position -> its records' (path, offset, view)

    def _owners(self, slots_per_share: list, param_count: int) -> list | None:
        """Which share owns each parameter, checked to be exactly one each (None: shares without
        files, nothing to replay)."""
        if any(slots is None for slots in slots_per_share):
            return None
        owner = [-1] * param_count
        own = self._own
        # This rank's chunk of a DTensor slot the own share records elsewhere (HSDP): the recording
        # share's, when its chunk entry is the own share's and that is this rank's live chunk.
        lent = {}
        if own is not None:
            mine = self._chunks[own]
            lent = {slot: share for slot, share in self._elsewhere[own].items()
                    if slot < param_count and self._chunks[share].get(slot) == mine.get(slot) and
                    (self._own_chunks or slot in self._live and dtensors.same_chunk(mine[slot], self._live[slot]))}
        for share, slots in enumerate(slots_per_share):
            for slot in slots:
                if slot < 0:   # a DTensor chunk: this rank's own if it is its live chunk
                    slot = -1 - slot
                    if slot < param_count and (lent.get(slot) == share or share == own and (
                            self._own_chunks or slot in self._live and
                            dtensors.same_chunk(self._chunks[share][slot], self._live[slot]))):
                        owner[slot] = share
                    elif slot < param_count and owner[slot] == -1:
                        owner[slot] = _ASSEMBLE   # unless the own share turns out to be it (above)
                    continue
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

    def prepare_read(self, position: int) -> None:
        """Called by replay in step order on the thread that drives it, before ``position`` goes to
        a worker: fetch the files that hold its records (each share's next one when the step moves
        into it) and take views of them. A share's earlier file is let go here: the records handed
        out keep what they still need of it alive (their views), so memory follows the records in
        flight, not the chain."""
        step = self.steps[position]
        views = []
        for share, steps in enumerate(self._records):
            file_position, offset, nbytes = steps[step]
            held_position, data = self._held[share]
            while held_position < file_position:   # files in order: every rank fetches the same ones
                held_position += 1
                data = self._fetch(share, held_position)
                self._held[share] = (held_position, data)
            path = self._shares[share].files[file_position][0]
            views.append((path, offset, None if data is None else memoryview(data)[offset:offset + nbytes]))
        self._ready[position] = views

    def read_for_replay(self, position: int, memory) -> tuple:
        """As BatchReader's: views of the files ``prepare_read`` fetched (no buffer of ``memory``)."""
        views = self._ready.pop(position)
        for path, _, view in views:
            if view is None:
                raise CorruptCheckpointError(path, "could not be read by the rank that reads it (see its warning)")
        return views, None

    def decode_record(self, position: int, data: list, *, owned: bool = False) -> StepRecord:
        """Verify every share's record of the step and join them (see the module doc). ``owned``:
        as BatchReader's (replay passes it: the files' memory is this chain's own, fetched for the
        replay, and each step is decoded once, so the values may be views of it)."""
        step = self.steps[position]
        records = [decode_record(view, name, offset, expected_step=step, owned=owned) for name, offset, view in data]
        assert self._owner is not None  # steps is empty otherwise
        first = records[0]
        if any(r.skipped != first.skipped for r in records):
            raise CorruptCheckpointError(self.path, f"the shares of step {step} disagree on whether it was skipped")
        grads: list = []
        if not first.skipped:
            if any(len(r.grads) != self._param_count for r in records):
                raise CorruptCheckpointError(self.path, f"a share of step {step} does not list every parameter")
            grads = [self._assembled(slot, records) if share == _ASSEMBLE else records[share].grads[slot]
                     for slot, share in enumerate(self._owner)]
        if self._own is not None:
            objects = records[self._own].objects
        else:  # a rank that did not exist: share 0's replicated objects, no RNG or extra state
            objects = {**records[0].objects, "rng": {}, "extra": {}}
        return StepRecord(step, first.skipped, grads, objects)

    def _assembled(self, slot: int, records: list) -> Compressed:
        """This rank's chunk of a DTensor gradient cut from every share's recorded chunk (each as its
        optimizer consumed it: a TopK record is its dense chunk with zeros where nothing was kept)."""
        # The shares that record this slot's chunk themselves (not those that name another: HSDP).
        recorded = [(share, r.grads[slot]) for share, r in enumerate(records) if slot not in self._elsewhere[share]]
        if all(g.kind == "none" for _, g in recorded):
            return recorded[0][1]
        pieces = []
        for share, grad in recorded:
            entry = self._chunks[share][slot]
            dense = torch.zeros(math.prod(entry["shape"]), dtype=next(g.values.dtype for _, g in recorded
                                                                     if g.values is not None))
            if grad.kind != "none":
                decompress_into(grad, dense)
            pieces.append((entry, dense))
        # No live DTensor (export, an unsharded model): the whole gradient.
        values = dtensors.assemble(self._live.get(slot), pieces[0][1].dtype, pieces).reshape(-1)
        return Compressed("dense", values.numel(), values)

    def close(self) -> None:
        self._records = []
        self._held = []
        self._ready.clear()
