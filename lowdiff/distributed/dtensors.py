"""DTensor state (FSDP2 ``fully_shard``, tensor parallelism) as each rank's own chunks: the chunk
entries the share files carry (docs/format.md, "Sharded state"), a DTensor's local chunk for the
capture, the DTensor rebuilt around a chunk read back, and the gradient target a replay writes a
recorded local gradient chunk through.

Why chunks and not gathered tensors: under FSDP2 each rank's optimizer consumes only its local
gradient chunk and updates only its local chunks of the state, so recording exactly those is what
makes the replay exact, and no rank ever holds (or writes) another's.
"""
from __future__ import annotations

import math

import torch

from lowdiff.errors import IncompatibleCheckpointError

_DTENSOR: list = []   # torch.distributed.tensor.DTensor, once a tensor named so was seen


def is_dtensor(tensor: object) -> bool:
    # By class name first: called for every gradient of every step, it must not import
    # torch.distributed.tensor (or pay for an import statement) when nothing is sharded.
    if type(tensor).__name__ != "DTensor" or not torch.distributed.is_available():
        return False
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return isinstance(tensor, _DTENSOR[0])


def local_chunk(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's local chunk of a DTensor (its own memory, no copy); any other tensor as it is."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor   # type: ignore[attr-defined]


def placement_name(placement) -> str:
    """"S<d>" for Shard(d), "R" for Replicate (the only placements wrap() lets through)."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(placement, Shard):
        return f"S{placement.dim}"
    if isinstance(placement, Replicate):
        return "R"
    raise ValueError(f"placement {placement!r} cannot be recorded (only Shard and Replicate)")


def _placement(name: str):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if name == "R" else Shard(int(name[1:]))


# What chunk_entry and replica_group say of a DTensor depends only on its spec (mesh, placements,
# global shape) and its local chunk's shape, and a full checkpoint asks for every DTensor of the
# state on the training thread (about 15 us each, 2 ms at the quick model's 160): kept by spec.
# {id(spec): (spec, local shape, chunk entry, replica group)}; the spec is held, so an id is not
# reused while it is here.
_BY_SPEC: dict = {}
_BY_SPEC_LIMIT = 1 << 14


def _facts(tensor) -> tuple:
    spec = tensor._spec
    local_shape = tuple(tensor._local_tensor.shape)
    known = _BY_SPEC.get(id(spec))
    if known is not None and known[0] is spec and known[1] == local_shape:
        return known
    if len(_BY_SPEC) >= _BY_SPEC_LIMIT:   # specs made anew at every step would never be found again
        _BY_SPEC.clear()
    known = _BY_SPEC[id(spec)] = (spec, local_shape, _chunk_entry(tensor), _replica_group(tensor))
    return known


def chunk_entry(tensor) -> dict:
    """The chunk entry (docs/format.md) of this rank's local chunk of the DTensor ``tensor`` (a
    new dict; its lists are shared with the next caller's: do not change them)."""
    return dict(_facts(tensor)[2])


def _chunk_entry(tensor) -> dict:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = tensor.device_mesh
    local_shape, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
    if tuple(local_shape) != tuple(tensor._local_tensor.shape):
        # A chunk laid out otherwise than torch's split rule (e.g. padded): its offsets would be wrong.
        raise ValueError(f"a DTensor of shape {tuple(tensor.shape)} holds a local chunk of shape "
                         f"{tuple(tensor._local_tensor.shape)}, not the {tuple(local_shape)} its placements give")
    return {"global_shape": list(tensor.shape), "mesh_shape": list(mesh.shape),
            "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            "placements": [placement_name(p) for p in tensor.placements], "offsets": list(offsets),
            "shape": list(local_shape)}


def replica_group(tensor) -> tuple:
    """The global ranks holding the same chunk of the DTensor ``tensor`` as this rank, this one
    included, in increasing order: those whose mesh coordinates differ from this rank's only on
    dimensions placed Replicate (HSDP's replicate dimension); just this rank when nothing is."""
    return _facts(tensor)[3]


def _replica_group(tensor) -> tuple:
    from torch.distributed.tensor import Replicate

    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None or not any(isinstance(p, Replicate) for p in tensor.placements):
        return (torch.distributed.get_rank(),)
    where = tuple(slice(None) if isinstance(p, Replicate) else c for p, c in zip(tensor.placements, coordinate))
    return tuple(sorted(int(r) for r in mesh.mesh[where].reshape(-1).tolist()))


def assign_holders(items: list) -> dict:
    """{name: the rank that writes it} for ``items`` [(name, replica group, bytes)] (docs/format.md,
    "2-D meshes"): within each group, largest first (ties: in ``items`` order) to the rank with the
    fewest bytes so far (ties: the lowest). Every rank of a group has the same names and sizes, so
    each computes the same answer without a collective."""
    by_group: dict = {}
    for position, (name, group, nbytes) in enumerate(items):
        by_group.setdefault(tuple(group), []).append((-nbytes, position, name))
    out = {}
    for group, members in by_group.items():
        loads = dict.fromkeys(group, 0)
        for negative, _, name in sorted(members):
            holder = min(group, key=lambda r: (loads[r], r))
            out[name] = holder
            loads[holder] -= negative
    return out


def lacks_chunk(own, holder, key: str) -> str | None:
    """Why full-checkpoint share ``holder`` (its index) does not hold the chunk of ``key`` that share
    ``own`` names it for in ``elsewhere`` ("2-D meshes": the same chunk entry, in its own tensors,
    of the dtype named), or None: it does. Readers and ``verify`` ask it of the indexes alone."""
    if key not in holder.dtensors or key in holder.elsewhere:
        return f"no chunk of {key!r}" + (" (it names another share for it)" if key in holder.elsewhere else "")
    differ = entry_difference(holder.dtensors[key], own.dtensors[key])
    if differ:
        return f"the chunk of {key!r} with {differ}"
    dtype = next((t.dtype for t in holder.tensors if t.key == key), None)
    want = own.elsewhere[key]["dtype"]
    return f"the chunk of {key!r} in {dtype}, not {want}" if dtype != want else None


def lacks_gradient_chunk(own, holder, slot: int) -> str | None:
    """Why differential share ``holder`` (its index) does not record the gradient chunk of parameter
    ``slot`` that share ``own`` names it for in ``elsewhere`` (None: it does)."""
    if slot not in holder.slots or slot not in holder.dtensors:
        return f"no gradient chunk of parameter {slot}"
    differ = entry_difference(holder.dtensors[slot], own.dtensors[slot])
    return f"the gradient chunk of parameter {slot} with {differ}" if differ else None


def entry_difference(theirs: dict, mine: dict) -> str:
    """The fields in which two chunk entries differ, in words ("" if equal)."""
    return ", ".join(f"{field} {theirs.get(field)} (named with {mine.get(field)})"
                     for field in sorted(set(theirs) | set(mine)) if theirs.get(field) != mine.get(field))


def meshes_of(tensors) -> dict:
    """{(mesh shape, dim names): mesh} of the DTensors among ``tensors``."""
    out: dict = {}
    for t in tensors:
        if is_dtensor(t):
            mesh = t.device_mesh
            out.setdefault((tuple(mesh.shape), tuple(mesh.mesh_dim_names or ())), mesh)
    return out


def rebuild(path: str, key: str, chunk: torch.Tensor, entry: dict, meshes: dict):
    """The DTensor whose local chunk on this rank is ``chunk`` (read from ``path``), on the live mesh
    that ``entry`` names. Refused (IncompatibleCheckpointError) when no live DTensor has that mesh or
    this rank's chunk starts elsewhere: the checkpoint was written at another world size or mesh,
    which this lowdiff does not reshard."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = meshes.get((tuple(entry["mesh_shape"]), tuple(entry["mesh_dim_names"] or ())))
    if mesh is None:
        shapes = sorted(shape for shape, _ in meshes) or "none"
        raise IncompatibleCheckpointError(
            f"{path}: {key!r} was written on a device mesh of shape {tuple(entry['mesh_shape'])}; the live model's "
            f"DTensors have meshes of shapes {shapes}. Resuming sharded state at another world size or mesh is not "
            f"supported yet: resume with the world size it was written with")
    placements = [_placement(name) for name in entry["placements"]]
    shape, offsets = compute_local_shape_and_global_offset(entry["global_shape"], mesh, placements)
    if list(offsets) != entry["offsets"] or tuple(shape) != tuple(chunk.shape):
        raise IncompatibleCheckpointError(
            f"{path}: this rank's chunk of {key!r} starts at {list(offsets)} with shape {tuple(shape)} on the live "
            f"mesh, the recorded one at {entry['offsets']} with shape {tuple(chunk.shape)}: the checkpoint was written "
            f"by other ranks (resharding is not supported yet)")
    stride = [math.prod(entry["global_shape"][i + 1:]) for i in range(len(entry["global_shape"]))]
    return DTensor.from_local(chunk, mesh, placements, run_check=False, shape=torch.Size(entry["global_shape"]),
                              stride=tuple(stride))


def outline(entry: dict, dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of the DTensor's global shape (what compat checks compare with the live one)."""
    return torch.empty(entry["global_shape"], dtype=dtype, device="meta")


class LocalGradTarget:
    """What a replay (lowdiff.step.apply.GradientBuffers) takes for a DTensor parameter: it has the
    local chunk's dtype, device, shape and ``numel()``, and setting ``grad`` to a local gradient chunk
    sets the parameter's gradient to the DTensor around it (same mesh and placements, no copy), which
    the user's optimizer then consumes as it did in training."""

    def __init__(self, param):
        self.param = param
        local = param._local_tensor
        self.dtype, self.device, self.shape = local.dtype, local.device, local.shape
        self._numel = local.numel()
        self._given: tuple | None = None   # (local chunk, the DTensor made of it)

    def numel(self) -> int:
        return self._numel

    @property
    def grad(self):
        grad = self.param.grad
        if grad is None:
            return None
        if self._given is not None and grad is self._given[1]:
            return self._given[0]
        return grad._local_tensor

    @grad.setter
    def grad(self, value) -> None:
        if value is None:
            self.param.grad, self._given = None, None
            return
        from torch.distributed.tensor import DTensor

        p = self.param
        wrapped = DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                     stride=p.stride())
        p.grad, self._given = wrapped, (value, wrapped)


def grad_targets(params: list) -> list:
    """``params`` with each DTensor replaced by its LocalGradTarget (see there)."""
    return [LocalGradTarget(p) if is_dtensor(p) else p for p in params]


# ---------------------------------------------------------------- resharding (another world size or mesh)
# Optimizers whose update of an element reads only that element's state and gradient (and scalars):
# their state after a step does not depend on how the tensors are cut into chunks.
ELEMENTWISE = frozenset(f"torch.optim.{module}.{name}" for module, name in (
    ("sgd", "SGD"), ("adam", "Adam"), ("adamw", "AdamW"), ("adagrad", "Adagrad"), ("rmsprop", "RMSprop"),
    ("adamax", "Adamax"), ("nadam", "NAdam"), ("radam", "RAdam"), ("adadelta", "Adadelta")))


def check_reshardable(path: str, optimizer_class: str) -> None:
    """Refuse resharding the state of an optimizer not known to work element by element (one that
    reads a whole tensor, e.g. its norm, would step differently on other chunks)."""
    if optimizer_class not in ELEMENTWISE:
        raise IncompatibleCheckpointError(
            f"{path}: sharded state of optimizer {optimizer_class} cannot be resumed at another world size or mesh: "
            f"lowdiff reshards only optimizers that work element by element "
            f"({', '.join(sorted(name.rsplit('.', 1)[1] for name in ELEMENTWISE))}); resume at the world size it was "
            f"written with")


def live_chunk(tensor) -> tuple:
    """(mesh, placements, global shape, local shape, offsets) of a live DTensor on this rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tensor.device_mesh, tuple(tensor.placements), tuple(tensor.shape), tuple(shape), tuple(offsets)


def same_chunk(entry: dict, live) -> bool:
    """Whether the recorded chunk ``entry`` is this rank's chunk of the live DTensor ``live``."""
    mesh, placements, global_shape, shape, offsets = live_chunk(live)
    return (list(global_shape), list(mesh.shape), [placement_name(p) for p in placements], list(offsets),
            list(shape)) == (entry["global_shape"], entry["mesh_shape"], entry["placements"], entry["offsets"],
                             entry["shape"])


def copy_overlap(dst: torch.Tensor, dst_offsets, src: torch.Tensor, src_offsets) -> None:
    """Copy the part of ``src`` (a chunk at ``src_offsets`` of a global tensor) that overlaps ``dst``
    (a chunk at ``dst_offsets`` of the same tensor) into ``dst``."""
    dst_index, src_index = [], []
    for d_off, d_n, s_off, s_n in zip(dst_offsets, dst.shape, src_offsets, src.shape):
        low, high = max(d_off, s_off), min(d_off + d_n, s_off + s_n)
        if high <= low:
            return
        dst_index.append(slice(low - d_off, high - d_off))
        src_index.append(slice(low - s_off, high - s_off))
    dst[tuple(dst_index)] = src[tuple(src_index)]


def assemble(live, dtype: torch.dtype, pieces) -> torch.Tensor:
    """This rank's chunk of ``live`` from recorded chunks ``pieces`` [(chunk entry, local tensor)]
    that tile the tensor: of the live DTensor (its mesh and placements), or the whole tensor when
    ``live`` is not a DTensor (an unsharded model, or ``export``: a plain tensor of the global shape)."""
    if is_dtensor(live):
        _, _, _, shape, offsets = live_chunk(live)
    else:
        shape = tuple(pieces[0][0]["global_shape"])
        offsets = (0,) * len(shape)
    out = torch.zeros(shape, dtype=dtype)
    for entry, tensor in pieces:
        copy_overlap(out, offsets, tensor.view(entry["shape"]), entry["offsets"])
    return out


def rewrap(chunk: torch.Tensor, live):
    """The DTensor on ``live``'s mesh and placements whose local chunk is ``chunk``."""
    from torch.distributed.tensor import DTensor

    stride = [math.prod(live.shape[i + 1:]) for i in range(len(live.shape))]
    return DTensor.from_local(chunk, live.device_mesh, live.placements, run_check=False, shape=live.shape,
                              stride=tuple(stride))
