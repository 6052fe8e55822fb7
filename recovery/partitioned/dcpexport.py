"""``export --format dcp``: a step's state as a torch.distributed.checkpoint (DCP) directory, and, for
a sharded (FSDP2) directory, one written share by share without gathering anything.

The keys are those of ``get_state_dict(model, optimizer,
options=StateDictOptions(flatten_optimizer_state_dict=True))`` (model FQNs; "state.<fqn>.<name>";
"param_groups.<fqn>.<key>"), plus "lowdiff.step". Only the model and the optimizer's per-parameter
state and groups: the scheduler, extra state and RNG are not in DCP's state dict (the torch format
keeps rank 0's).

Sharded: one process rebuilds the state of share 0, 1, ... in turn, each as the share's own chunks
(recovery.partitioned.load_set's ``as_share``: that share's chunks of the full set, replayed with the
gradient chunks its optimizer consumed), and hands each share's chunks to DCP's own storage writer as
that rank would have written them (``__<rank>_0.distcp``), each chunk a SHARD at its global offsets;
the replicated rest (AdamW's step counts, buffers, the groups, "lowdiff.step") goes with share 0, as
DCP's planner dedups it; a chunk that an earlier share holds at the same offsets (HSDP: the ranks
of a replicate group hold the same chunks) is written once, by the first. The metadata, built from
every share's plan, is committed last. Memory holds one share's state at a time; ``dcp.load`` reads
each new rank's chunk from the pieces that overlap it, at any world size, as after a DCP save by the
job itself.
"""
from __future__ import annotations

import os
import typing
import warnings

import torch

import fastio
from lowdiff.errors import CorruptCheckpointError
from lowdiff.format.sharefile import read_full_share_index

if typing.TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import SavePlanner


def dcp_state(model_state: dict, optimizer, names: dict, step: int) -> tuple[dict, dict]:
    """(the DCP state dict of get_state_dict's flattened keys, {its key: lowdiff's state key} of
    each tensor that lowdiff's full-set index may list as a DTensor chunk). ``names``: {id(param):
    its FQN}; ``optimizer``'s parameters in slot order (the index's ``param_names`` order)."""
    state: dict = {}
    keys: dict = {}
    for name, value in model_state.items():
        state[name] = value
        keys[name] = f"/model/{name}"
    slots = {id(p): slot for slot, p in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    for group in optimizer.param_groups:
        for param in group["params"]:
            fqn = names[id(param)]
            for key, value in optimizer.state.get(param, {}).items():
                state[f"state.{fqn}.{key}"] = value
                keys[f"state.{fqn}.{key}"] = f"/optimizer/state/{slots[id(param)]}/{key}"
            for key, value in group.items():
                if key != "params":
                    state[f"param_groups.{fqn}.{key}"] = value
    state["lowdiff.step"] = step
    return state, keys


def save_gathered(output, state: dict) -> None:
    """Write ``state`` (whole tensors) with DCP's own writer, each tensor one chunk."""
    import torch.distributed.checkpoint as dcp

    # no_dist: this one process writes everything, even inside a job with a process group; DCP warns
    # that it assumes so whenever no_dist holds, which here is the intent, not a problem.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.save(state, checkpoint_id=os.fspath(output), no_dist=True)


class _ShareData:
    """What DCP's storage writer asks a planner for (``resolve_data``): a share's chunks, and from
    share 0 the replicated rest, as DCP's default planner resolves it."""

    def __init__(self, chunks: dict, rest):
        self._chunks = chunks
        self._rest = rest

    def resolve_data(self, item):
        from torch.distributed.checkpoint.planner import WriteItemType

        if item.type == WriteItemType.SHARD:
            return self._chunks[item.index.fqn]
        return self._rest.resolve_data(item)


def share_index(path: str):
    """The index of the full-set share at ``path`` (its ``count``, and ``dtensors``: {lowdiff state
    key: chunk entry})."""
    with fastio.Reader(path) as reader:
        return read_full_share_index(path, reader)


class ShardedWriter:
    """A DCP directory written share by share (see the module doc). Call ``add(rank, state, keys,
    chunks)`` for ranks 0, 1, ..., count - 1 in order, then ``commit()``; nothing is readable as a
    checkpoint before ``commit()`` writes the metadata."""

    def __init__(self, output, count: int):
        from torch.distributed.checkpoint import FileSystemWriter

        self._output = os.fspath(output)
        self._writer = FileSystemWriter(self._output)
        self._count = count
        self._plans: list = []
        self._results: list = []
        self._mappings: dict = {}
        self._written: set = set()   # (key, offsets) of the chunks written so far

    def add(self, rank: int, state: dict, keys: dict, chunks: dict) -> None:
        """Write share ``rank``'s part: the tensors of ``state`` whose lowdiff key (``keys``) is a
        chunk of ``chunks`` (its full-set index's entries) at their global offsets; from share 0
        also everything else, once."""
        from torch.distributed.checkpoint import DefaultSavePlanner
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

        if rank != len(self._plans):
            raise ValueError(f"share {rank} added after {len(self._plans)} shares: add them in order")
        items, data = [], {}
        rest = {}
        for key, value in state.items():
            entry = chunks.get(keys.get(key, ""))
            if entry is None:
                rest[key] = value
                continue
            if tuple(value.shape) != tuple(entry["shape"]):
                raise CorruptCheckpointError(self._output, f"share {rank}'s {key!r} has shape {tuple(value.shape)}, "
                                                           f"its chunk entry {entry['shape']}")
            self._mappings[key] = (key,)
            if value.numel() == 0:
                continue   # an empty chunk (more ranks than rows): nothing of the tensor to write
            offsets = torch.Size(entry["offsets"])
            if (key, offsets) in self._written:
                # HSDP: the ranks of a replicate group hold the same chunk (the same bytes, by the
                # same all-reduced gradients); written once, by the first, as DCP's save dedups it.
                continue
            self._written.add((key, offsets))
            items.append(WriteItem(index=MetadataIndex(key, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(
                                       chunk=ChunkStorageMetadata(offsets=offsets, sizes=value.shape),
                                       properties=TensorProperties.create_from_tensor(value),
                                       size=torch.Size(entry["global_shape"]))))
            data[key] = value.detach().contiguous()
        planner = None
        if rank == 0:   # the replicated rest, planned (flattened, BYTE_IO for non-tensors) as DCP does
            planner = DefaultSavePlanner()
            planner.set_up_planner(rest, None, True)
            rest_plan = planner.create_local_plan()
            items = list(rest_plan.items) + items
            self._mappings.update(rest_plan.planner_data or {})
        # As rank ``rank`` of a job that does not exchange plans: the writer names its files
        # __<rank>_<n>.distcp, as a job's rank would.
        self._writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=False)
        plan = self._writer.prepare_local_plan(SavePlan(items))
        # The writer calls nothing of its planner but resolve_data (a whole SavePlanner would plan too).
        share_data = typing.cast("SavePlanner", _ShareData(data, planner))
        self._results.append(self._writer.write_data(plan, share_data).wait())
        self._plans.append(plan)

    def abandon(self) -> None:
        """Remove the data files written so far (no metadata was: nothing would read them)."""
        for rank in range(len(self._plans)):
            for name in os.listdir(self._output):
                if name.startswith(f"__{rank}_") and name.endswith(".distcp"):
                    os.unlink(os.path.join(self._output, name))
        self._plans, self._results, self._written = [], [], set()

    def commit(self) -> None:
        """Write the metadata of every share's chunks (DCP's global plan), last."""
        import dataclasses

        from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

        if len(self._plans) != self._count:
            raise ValueError(f"{len(self._plans)} of {self._count} shares were added")
        _, metadata = create_default_global_save_plan(self._plans)
        metadata = dataclasses.replace(metadata, planner_data=dict(self._mappings))
        self._writer.set_up_storage_writer(True)   # the one global .metadata, as the coordinator writes it
        self._writer.finish(metadata, self._results)
