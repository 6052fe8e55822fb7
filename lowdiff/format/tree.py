"""Splitting nested state (dicts, lists, tuples) into a tensor-free skeleton and a tensor table,
and serializing small objects without unsafe pickle on load."""
from __future__ import annotations

import io
import json
import struct

import numpy as np
import torch

_TENSOR_TAG = "__lowdiff_tensor__"


def split_tensors(tree, prefix: str = ""):
    """Return (skeleton, [(key, tensor)]): every tensor in ``tree`` replaced by a tagged key.

    Tensors that are one memory (``same_memory``: tied weights, which ``state_dict()`` lists under
    each name) are listed once, under the first path holding them, and every place holding them
    names that key (docs/format.md, "state skeleton"): stored once, and joined back as one tensor."""
    tensors: list[tuple[str, torch.Tensor]] = []
    # Tensors listed so far by the address of their first element: [memory key or None (not yet
    # computed), path, tensor]. The key (several attribute reads per tensor) is computed only for
    # tensors whose address another one shares: ties are rare, and a full checkpoint splits its
    # state on the training thread.
    by_address: dict = {}

    def walk(node, path):
        if isinstance(node, torch.Tensor):
            holders = by_address.setdefault(_address(node), [])
            if holders:
                memory = same_memory(node)
                if memory is not None:
                    for holder in holders:
                        if holder[0] is None:
                            holder[0] = same_memory(holder[2]) or ()
                        if holder[0] == memory:
                            return {_TENSOR_TAG: holder[1]}
                    holders.append([memory, path, node])
            else:
                holders.append([None, path, node])
            tensors.append((path, node))
            return {_TENSOR_TAG: path}
        if isinstance(node, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        return node

    return walk(tree, prefix), tensors


def _address(tensor: torch.Tensor):
    """Where ``tensor``'s first element is (its local chunk's, for a DTensor); tensors that
    ``same_memory`` joins have the same one. None where there is no data pointer to read."""
    local = getattr(tensor, "_local_tensor", None)
    try:
        return (local if isinstance(local, torch.Tensor) else tensor).data_ptr()
    except RuntimeError:
        return None


def same_memory(tensor: torch.Tensor) -> tuple | None:
    """What makes two tensors one memory: the same device, first element's address, dtype, shape,
    strides and lazy conjugate/negative bits (then their values are the same at every moment).
    None for tensors never joined: empty ones (no memory to share), other layouts, quantized ones
    (their scales are not in this key) and subclasses (whose state is more than their memory), except
    a DTensor (FSDP2): its local chunk's memory, global shape and placements (a tied weight under
    fully_shard is one DTensor listed under two names)."""
    local = getattr(tensor, "_local_tensor", None)
    if type(tensor).__name__ == "DTensor" and isinstance(local, torch.Tensor):
        key = same_memory(local)
        return None if key is None else (*key, "DTensor", tuple(tensor.shape), repr(getattr(tensor, "placements", ())))
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.layout != torch.strided \
            or tensor.is_quantized or tensor.numel() == 0 or tensor.device.type == "meta":
        return None
    return (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride(),
            tensor.is_conj(), tensor.is_neg())


def join_tensors(skeleton, lookup):
    """Inverse of split_tensors: ``lookup(key)`` returns the tensor stored under ``key``."""
    if isinstance(skeleton, dict):
        if len(skeleton) == 1 and _TENSOR_TAG in skeleton:
            return lookup(skeleton[_TENSOR_TAG])
        return {k: join_tensors(v, lookup) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [join_tensors(v, lookup) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(join_tensors(v, lookup) for v in skeleton)
    return skeleton


# Small objects (hyper-parameters, scheduler/sampler state, RNG states, buffers) are stored as
# tagged JSON plus a table of raw tensor bytes: about 10x faster to write and read than
# torch.save, exact for floats (repr round trips), and safe to load (no pickle). Objects JSON cannot
# express (a custom class in a user's state_dict) fall back to torch.save, loaded weights_only.
_JSON_FORMAT = b"J"
_TORCH_FORMAT = b"T"
_RESERVED = ("t", "d", "x", "b")   # one-key JSON objects with these keys are tags
_HEAD = struct.Struct("<I")


_SCALARS = (int, float, str, bool, type(None))


class _Unsupported(Exception):
    pass


def _encode(node, tensors: list):
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, torch.Tensor):
        tensors.append(node.detach().cpu().contiguous())
        return {"x": len(tensors) - 1}
    if isinstance(node, (list, tuple)):
        # Fast path for long flat sequences such as python's RNG state (625 ints).
        items = list(node) if all(type(v) in _SCALARS for v in node) else [_encode(v, tensors) for v in node]
        return items if isinstance(node, list) else {"t": items}
    if isinstance(node, dict):
        if len(node) == 1 and type(node.get(_TENSOR_TAG)) is str:
            return node   # a skeleton's tensor tag (hundreds in a full checkpoint's): encodes as itself
        if all(type(k) is str for k in node) and not (len(node) == 1 and next(iter(node)) in _RESERVED):
            return {k: _encode(v, tensors) for k, v in node.items()}
        return {"d": [[_encode(k, tensors), _encode(v, tensors)] for k, v in node.items()]}
    if isinstance(node, bytes):
        return {"b": node.hex()}
    raise _Unsupported(type(node).__name__)


def _decode(node, tensors: list):
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    if isinstance(node, dict):
        if len(node) == 1:
            (tag, value), = node.items()
            if tag == "x":
                return tensors[value]
            if tag == "t":
                return tuple(_decode(v, tensors) for v in value)
            if tag == "d":
                return {_decode(k, tensors): _decode(v, tensors) for k, v in value}
            if tag == "b":
                return bytes.fromhex(value)
        return {k: _decode(v, tensors) for k, v in node.items()}
    return node


def dumps(obj) -> bytes:
    """Serialize small state; see the comment above for the format choice."""
    tensors: list = []
    try:
        skeleton = _encode(obj, tensors)
    except _Unsupported:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return _TORCH_FORMAT + buffer.getvalue()
    table = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    head = json.dumps([skeleton, table], separators=(",", ":"), allow_nan=True).encode()
    parts: list = [_JSON_FORMAT, _HEAD.pack(len(head)), head]
    parts += [tensor_bytes(t) for t in tensors]
    return b"".join(parts)


def loads(data, path: str):
    """Load what ``dumps`` wrote (no arbitrary code runs: JSON, or torch.load weights_only)."""
    from lowdiff.errors import CorruptCheckpointError

    data = bytes(data)
    try:
        if data[:1] == _TORCH_FORMAT:
            return torch.load(io.BytesIO(data[1:]), weights_only=True)
        if data[:1] != _JSON_FORMAT:
            raise ValueError(f"unknown object encoding {data[:1]!r}")
        (head_len,) = _HEAD.unpack_from(data, 1)
        pos = 1 + _HEAD.size + head_len
        skeleton, table = json.loads(data[1 + _HEAD.size:pos])
        tensors = []
        for dtype_name, shape in table:
            dtype = getattr(torch, dtype_name)
            count = 1
            for n in shape:
                count *= n
            nbytes = count * torch.empty((), dtype=dtype).element_size()
            if pos + nbytes > len(data):
                raise ValueError("tensor bytes run past the end of the objects section")
            chunk = bytearray(data[pos:pos + nbytes])
            tensors.append(torch.frombuffer(chunk, dtype=dtype).view(shape) if nbytes else
                           torch.empty(shape, dtype=dtype))
            pos += nbytes
        return _decode(skeleton, tensors)
    except Exception as exc:  # torch and json raise several types for damaged input
        raise CorruptCheckpointError(path, f"cannot load stored objects: {type(exc).__name__}: {exc}") from None


def joined(tensors: list) -> torch.Tensor:
    """The 1-D ``tensors`` as one: a view where they lie back to back in one storage
    (``joined_in_place``), else one concatenation."""
    if len(tensors) == 1:
        return tensors[0] if tensors[0].dim() == 1 else tensors[0].reshape(-1)
    view = joined_in_place(tensors)
    return view if view is not None else torch.cat(tensors)


def joined_in_place(tensors: list) -> torch.Tensor | None:
    """One view of the 1-D ``tensors`` when they lie back to back in one storage, in order (a GPU
    record's pinned host copy, lowdiff.capture.devicecopy; a batch of dense gradients copied at
    once), else None. Reading them in place saves the writer a copy of the record's bytes.
    Every start must follow the previous end; the first and the last must share a storage, so
    the view stays inside that storage whatever lies between."""
    if len(tensors) < 2 or any(t.dtype != tensors[0].dtype for t in tensors):
        return None
    tensors = [t for t in tensors if t.numel()]   # an empty one adds no bytes (and has no place)
    if not tensors:
        return None
    first, last = tensors[0], tensors[-1]
    dtype, device, itemsize = first.dtype, first.device, first.element_size()
    end = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != end or not t.is_contiguous():
            return None
        end += t.numel() * itemsize
    storage = first.untyped_storage()
    if last.device != device or last.untyped_storage().data_ptr() != storage.data_ptr():
        return None
    numel = (end - first.data_ptr()) // itemsize
    return torch.empty(0, dtype=dtype, device=device).set_(storage, first.storage_offset(), (numel,), (1,))


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of ``tensor`` (any dtype, on the CPU) as a memoryview: a view where it is
    contiguous."""
    if tensor.numel() == 0:
        return memoryview(b"")
    # .data is memoryview(array); numpy's stubs declare no buffer protocol before Python 3.12.
    if tensor.device.type == "cpu" and tensor.dtype in _NUMPY_VIEWABLE and tensor.is_contiguous():
        # numpy views take no torch call: on the writer thread each torch call lets go of the GIL
        # and may wait a whole switch interval to get it back from a busy training thread.
        return tensor.numpy().reshape(-1).view(np.uint8).data
    return tensor.contiguous().view(-1).view(torch.uint8).numpy().data


# dtypes whose CPU tensors numpy can view as they are (bfloat16 has no numpy dtype).
_NUMPY_VIEWABLE = frozenset({torch.float32, torch.float64, torch.float16, torch.int8, torch.uint8, torch.int16,
                             torch.int32, torch.int64, torch.bool})
