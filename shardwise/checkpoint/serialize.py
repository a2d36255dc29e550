"""Split nested Python state into JSON plus named tensors (and back) — no pickle.

Tensors become ``{"__tensor__": key}`` references into a safetensors file;
tuples and dicts with non-string keys are tagged so they come back as they
went in.  Anything else that JSON cannot hold is an error naming its path.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np
import torch


def split_state(obj: Any, prefix: str) -> tuple[Any, dict[str, torch.Tensor]]:
    tensors: dict[str, torch.Tensor] = {}
    return _split(obj, prefix, tensors), tensors


def _split(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(obj))
        return {"__ndarray__": path}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: _split(v, f"{path}.{k}", tensors) for k, v in obj.items()}
        return {"__items__": [[_split(k, f"{path}.key{i}", tensors), _split(v, f"{path}.{i}", tensors)]
                              for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {"__tuple__": [_split(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_split(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    raise TypeError(
        f"cannot save {type(obj).__name__} at '{path}' in a checkpoint: only tensors, numbers, strings, "
        "lists, tuples and dicts are stored (shardwise checkpoints never use pickle)"
    )


def join_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [join_state(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy()
    if "__tuple__" in obj:
        return tuple(join_state(v, tensors) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {join_state(k, tensors): join_state(v, tensors) for k, v in obj["__items__"]}
    if "__dtype__" in obj:
        return getattr(torch, obj["__dtype__"])
    return {k: join_state(v, tensors) for k, v in obj.items()}
