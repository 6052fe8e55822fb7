"""DistributedDataParallel support: a comm hook that compresses each rank's gradient bucket,
exchanges the compressed parts, and aggregates them deterministically; and the recording of
exactly what the hook returned.

Aggregation: all ranks all-gather (indices, values) of their top-k selection; each rank adds the
parts into a zero bucket in rank order with ``index_add_`` (indices unique per rank, so no
atomics), then divides by the world size. Every rank computes the same bytes, and the optimizer
consumes exactly them. The gradient handed to the optimizer is therefore sparse (the union of the
ranks' selections); ``step()`` records its entries whose bits are not zero (lowdiff.distributed.nonzero), which
reproduce it exactly, also a -0.0 that clipping or the user's own change of the gradient leaves.
"""
import os
from typing import TypeGuard

import torch
import torch.distributed as dist

from lowdiff.distributed.nonzero import nonzero_elements
from lowdiff.step.compress import Compressed


def is_ddp(model: object) -> TypeGuard[torch.nn.parallel.DistributedDataParallel]:
    return isinstance(model, torch.nn.parallel.DistributedDataParallel)


def distributed_rank() -> tuple[int, int]:
    """(rank, world size), (0, 1) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class CompressedAllReduce:
    """DDP comm hook state and callable: ``model.register_comm_hook(state, state.hook)``."""

    def __init__(self, compressor, residuals: dict, process_group=None, params: list | None = None):
        self.compressor = compressor
        # Per-rank error-feedback residuals, keyed by the parameter's position in the optimizer
        # (``params``), never by bucket: DDP rebuilds its buckets after the first iteration, and a
        # checkpoint must be resumable with other buckets (another world size, another version).
        self.residuals = residuals
        self.process_group = process_group
        self.slot_of = {id(p): slot for slot, p in enumerate(params or [])}

    def compress(self, bucket: dist.GradBucket) -> Compressed:
        """Compress the bucket's flat gradient, with the residuals of its parameters."""
        flat = bucket.buffer()
        if not self.compressor.error_feedback:
            return self.compressor.compress(flat, 0, {})
        params = bucket.parameters()
        slots = [self.slot_of[id(p)] for p in params]
        sizes = [p.numel() for p in params]
        if sum(sizes) != flat.numel():
            raise RuntimeError(f"DDP bucket of {flat.numel()} elements holds parameters of {sum(sizes)}")
        held = [self.residuals.pop(slot, None) for slot in slots]
        scratch = {}
        if any(r is not None for r in held):
            scratch[0] = torch.cat([r.reshape(-1) if r is not None else flat.new_zeros(n) for r, n in zip(held, sizes)])
        part = self.compressor.compress(flat, 0, scratch)
        if 0 in scratch:
            for slot, piece in zip(slots, scratch[0].split(sizes)):
                self.residuals[slot] = piece
        return part

    @staticmethod
    def hook(state: "CompressedAllReduce", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        # No postponed annotations in this module: DDP checks this return annotation at run time.
        group = state.process_group
        world = dist.get_world_size(group)
        flat = bucket.buffer()
        part = state.compress(bucket)
        if part.kind == "dense":
            work = dist.all_reduce(flat, group=group, async_op=True)
            return work.get_future().then(lambda fut: fut.value()[0].div_(world))
        assert part.indices is not None and part.values is not None  # a sparse part has both
        sent = part.indices.to(torch.int32).contiguous()  # half the bytes of int64 on the wire
        indices = [torch.empty_like(sent) for _ in range(world)]
        values = [torch.empty_like(part.values) for _ in range(world)]
        dist.all_gather(indices, sent, group=group)
        dist.all_gather(values, part.values.contiguous(), group=group)
        out = torch.zeros_like(flat)
        for rank_indices, rank_values in zip(indices, values):  # fixed rank order: deterministic
            out.index_add_(0, rank_indices.to(torch.int64), rank_values)
        out.div_(world)
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(out)
        return future


class AggregatedRecorder:
    """The compressor ``step()`` uses under DDP: the gradient already is what the hook returned;
    record it as sparse (its nonzeros) or dense, without changing it."""

    def __init__(self, sparse: bool):
        self.sparse = sparse
        self.error_feedback = False
        self._counts: dict = {}   # slot -> nonzeros at its last step: the next step's likely count

    def compress(self, grad: torch.Tensor, slot: int, residuals: dict) -> Compressed:
        flat = grad.detach().reshape(-1)
        if not self.sparse:
            return Compressed("dense", flat.numel(), flat.clone())
        indices, values = nonzero_elements(flat, self._counts.get(slot, 0))
        self._counts[slot] = indices.numel()
        return Compressed("sparse", flat.numel(), values, indices)

    def __repr__(self):
        return f"AggregatedRecorder(sparse={self.sparse})"


def init_process_group(backend: str | None = None, **kwargs) -> None:
    """``torch.distributed.init_process_group`` that survives torchrun's restarts.

    torchrun (``--max-restarts``) keeps one store, its agent's, for every start of the job, and each
    start's process group publishes its ranks' addresses under the same keys as the last. A rank of
    the new start that reads a key before its peer rewrote it gets the address of a dead process:
    gloo's connect is refused or hangs (seen here with torch 2.13: a restarted rank that came up
    3 s after the others hung the job). Under torchrun with the agent's store, this joins the group
    through that store with a prefix naming the start (TORCHELASTIC_RESTART_COUNT), so no start
    reads another's keys. Anywhere else, and when ``store`` or an ``init_method`` other than env://
    is given, it is ``init_process_group`` unchanged."""
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    if restart is None or not agent_store or "store" in kwargs or kwargs.get("init_method", "env://") != "env://":
        dist.init_process_group(backend, **kwargs)
        return
    kwargs.pop("init_method", None)
    rank = kwargs.pop("rank", None)
    world = kwargs.pop("world_size", None)
    rank = int(os.environ["RANK"]) if rank is None or rank < 0 else rank
    world = int(os.environ["WORLD_SIZE"]) if world is None or world < 0 else world
    timeout = kwargs.get("timeout") or dist.constants.default_pg_timeout
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                          is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore(f"lowdiff/start-{restart}", agent), rank=rank,
                            world_size=world, **kwargs)
