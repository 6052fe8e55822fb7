"""Sharded training lowdiff cannot record exactly: refused at ``wrap()``, before anything is written,
with a message that names the module or parameter and says what to do.

Why refuse rather than try: a sharded optimizer consumes a gradient that no single tensor of the
unsharded model holds (FSDP1's flat parameters, ZeRO's partitions, a DTensor's local shard). The
capture of an unsharded run reads ``param.grad`` and ``state_dict()`` as whole tensors; on sharded
state it either crashes half-way through a step (issue #31: ``.numpy()`` of a tensor subclass, a
null address in a copy) or, worse, records something other than what the optimizer consumed.

Refused (each check names the first offender it finds, in this order):

- ``torch.distributed.optim.ZeroRedundancyOptimizer``: each rank steps only its partition and
  broadcasts the rest, so no rank's ``step()`` consumes every recorded gradient;
- FSDP1 ``FullyShardedDataParallel`` anywhere in the model: its flat parameters are views whose
  layout FSDP owns;
- a DTensor parameter with a placement other than ``Shard``/``Replicate`` (``Partial`` holds a
  summand, not a value);
- an FSDP2 module whose ``OffloadPolicy`` is not the default (``CPUOffloadPolicy``): the optimizer
  then steps offloaded copies, not tested here;
- DTensor parameters outside ``fully_shard`` (tensor parallelism), or on a mesh of more than one
  dimension other than HSDP's (FSDP2 + tensor parallelism; a mesh of more than two dimensions): not
  supported yet. FSDP2 on a 1-D mesh and HSDP (``fully_shard(..., mesh=<2-D mesh>)``, placements
  ``(Replicate(), Shard(d))``) are recorded (lowdiff.distributed.dtensors); under HSDP the ranks of
  one replicate group hold the same chunks, and each chunk is written by one of them
  (docs/format.md, "2-D meshes").

Also refused: replica mode (``lowdiff.Replica``) with DTensor parameters (its CPU copy is of whole
tensors). Not refused: ``reshard_after_forward`` (it changes when parameters are gathered, not what the
optimizer consumes), and any FSDP2 ``MixedPrecisionPolicy`` (issue #31). Why mixed precision is exact
(read in torch 2.13's ``_fully_shard/_fsdp_param.py`` and ``_fsdp_collectives.py``): FSDP2 keeps the
sharded parameters, which the optimizer steps, in their own dtype (``orig_dtype``) and casts only the
all-gathered copy to ``param_dtype`` for forward and backward; ``foreach_reduce`` reduce-scatters (and,
under HSDP, all-reduces) in ``reduce_dtype`` (``param_dtype`` when unset), then casts the result back
to ``orig_dtype`` before it becomes the sharded parameter's ``.grad``. The optimizer so consumes a
gradient of the parameter's own dtype held in ``.grad`` at ``step()``, which is what lowdiff records;
the replay steps the same optimizer on the same chunk with it, and neither ``output_dtype`` nor
``cast_forward_inputs`` touch the optimizer. Tested with 2 gloo ranks (gloo runs the bfloat16 and
float16 collectives on CPU): ``param_dtype=bfloat16`` with ``reduce_dtype`` float32 and bfloat16 (and
``output_dtype=float32``), ``param_dtype=float16`` with ``reduce_dtype`` float32
(tests/distributed/test_fsdp2_mixed_precision.py).
"""
from __future__ import annotations

import torch

_NOT_YET = ("lowdiff records DTensor state only as FSDP2 fully_shard makes it on a 1-D mesh or on HSDP's 2-D "
            "(replicate, shard) mesh so far. Shard the model with fully_shard on a 1-D or HSDP mesh, or train "
            "with torch.nn.parallel.DistributedDataParallel, or "
            "checkpoint this model with torch.distributed.checkpoint")


def refuse_unsupported_sharding(optimizer: torch.optim.Optimizer, model: torch.nn.Module, *,
                                replica: bool = False) -> None:
    """Raise TypeError (a kind of object lowdiff cannot checkpoint) or ValueError (a setting of a
    supported kind) for sharded training lowdiff cannot record exactly. Cheap when nothing is sharded:
    one pass over the modules and one over the optimizer's parameters."""
    if not torch.distributed.is_available():
        return   # nothing sharded can exist
    # By class, not isinstance: importing torch.distributed.optim scripts functions with torch.jit,
    # which warns (DeprecationWarning) in torch 2.13; a ZeroRedundancyOptimizer has imported it already.
    if any(c.__name__ == "ZeroRedundancyOptimizer" and c.__module__.startswith("torch.distributed.optim")
           for c in type(optimizer).__mro__):
        raise TypeError("torch.distributed.optim.ZeroRedundancyOptimizer steps only this rank's partition of the "
                        "parameters and broadcasts the rest, so the gradients it consumes are not those of every "
                        "parameter lowdiff would record. Wrap the plain optimizer it holds instead "
                        f"({type(getattr(optimizer, 'optim', optimizer)).__name__}) under DistributedDataParallel: "
                        "lowdiff already writes each rank only a share of every checkpoint")
    _refuse_fsdp1(model)
    _refuse_placements(optimizer, model)
    _refuse_fsdp2_offload(model)
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    sharded = {id(p) for module in model.modules() if isinstance(module, FSDPModule) for p in module.parameters()}
    hsdp = _hsdp_parameters(model)
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        if id(p) not in sharded:
            raise TypeError(f"parameter {name!r} is a DTensor (placements {tuple(p.placements)}) outside any "
                            f"fully_shard()ed module (tensor parallelism): {_NOT_YET}")
        if replica:
            raise ValueError(f"parameter {name!r} is a DTensor: replica mode (lowdiff.Replica) does not keep "
                             f"sharded state yet; use full_every/batch_steps (differentials of the local chunks)")
        if p.device_mesh.ndim != 1 and id(p) not in hsdp:
            raise TypeError(f"parameter {name!r} is a DTensor on a {p.device_mesh.ndim}-D mesh of shape "
                            f"{tuple(p.device_mesh.shape)} (placements {tuple(p.placements)}): only HSDP's "
                            f"(Replicate(), Shard(d)) from fully_shard(..., mesh=<2-D mesh>) is recorded on a mesh of "
                            f"more than one dimension, not FSDP2 with tensor parallelism: {_NOT_YET}")


def _hsdp_parameters(model: torch.nn.Module) -> set:
    """ids of the parameters that HSDP shards: those of a module fully_shard()ed with a 2-D mesh
    (FSDP2 then shards over the second dimension and replicates over the first: placements
    (Replicate(), Shard(d))), each a DTensor on that very mesh. Under FSDP2 + tensor parallelism
    fully_shard gets a 1-D mesh and the parameters' mesh is another, 2-D one: not listed."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Replicate, Shard

    out: set = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = getattr(module._get_fsdp_state(), "_fsdp_param_group", None)
        mesh = getattr(getattr(group, "mesh_info", None), "mesh", None)
        if group is None or mesh is None or mesh.ndim != 2:
            continue
        for fsdp_param in group.fsdp_params:
            p = fsdp_param.sharded_param
            placements = tuple(p.placements)
            if p.device_mesh == mesh and len(placements) == 2 and isinstance(placements[0], Replicate) and \
                    type(placements[1]) is Shard:
                out.add(id(p))
    return out


def _refuse_fsdp1(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    for name, module in model.named_modules():
        if isinstance(module, FullyShardedDataParallel):
            where = f"module {name!r}" if name else "the model"
            raise TypeError(f"{where} is FSDP1 FullyShardedDataParallel: its flat parameters are views whose layout "
                            f"FSDP owns, so lowdiff cannot record what the optimizer consumes. Shard with FSDP2 "
                            f"(torch.distributed.fsdp.fully_shard) instead; note: {_NOT_YET}")


def _refuse_placements(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard

    names = {id(p): name for name, p in model.named_parameters()}
    for index, p in enumerate(p for group in optimizer.param_groups for p in group["params"]):
        if not isinstance(p, DTensor):
            continue
        odd = [placement for placement in p.placements if not isinstance(placement, (Shard, Replicate))]
        if odd:
            # Shard subclasses (a strided or padded shard) are Shard too; anything else is a partial value.
            name = names.get(id(p), f"#{index} of the optimizer")
            raise ValueError(f"parameter {name!r} has placement {odd[0]!r}: a rank holds a summand of the value, not "
                             f"a piece of it, so no rank's shard can be recorded or resumed. Redistribute it to "
                             f"Shard or Replicate placements before wrap()")


def _refuse_fsdp2_offload(model: torch.nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule, OffloadPolicy

    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        where = f"module {name!r}" if name else "the model"
        group = getattr(state, "_fsdp_param_group", None)
        offload = getattr(group, "offload_policy", None)
        if offload is not None and type(offload) is not OffloadPolicy:
            raise ValueError(f"{where} is fully_shard()ed with {offload!r}: the optimizer then steps offloaded "
                             f"copies, which lowdiff does not record; use the default OffloadPolicy()")

