"""Splitting nested state (dicts, lists, tuples) into a tensor-free skeleton and a tensor table,
and serializing small objects without unsafe pickle on load."""
from __future__ import annotations

import io

import torch

_TENSOR_TAG = "__lowdiff_tensor__"


def split_tensors(tree, prefix: str = ""):
    """Return (skeleton, [(key, tensor)]): every tensor in ``tree`` replaced by a tagged key."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def walk(node, path):
        if isinstance(node, torch.Tensor):
            tensors.append((path, node))
            return {_TENSOR_TAG: path}
        if isinstance(node, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            items = [walk(v, f"{path}/{i}") for i, v in enumerate(node)]
            return items if isinstance(node, list) else tuple(items)
        return node

    return walk(tree, prefix), tensors


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


def dumps(obj) -> bytes:
    """Serialize small state (hyper-parameters, scheduler and sampler state, RNG) with torch.save."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def loads(data: bytes, path: str):
    """Load what ``dumps`` wrote with ``weights_only=True`` (no arbitrary code from a checkpoint)."""
    from .errors import CorruptCheckpointError

    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # torch raises several types for bad or disallowed pickles
        raise CorruptCheckpointError(path, f"cannot load stored objects: {type(exc).__name__}: {exc}") from None
