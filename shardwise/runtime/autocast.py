"""DeepSpeed's ``torch_autocast`` block: the forward runs under ``torch.autocast``, weights stay fp32.

``lower_precision_safe_modules`` (dotted class names, DeepSpeed's default: Linear and Conv1d/2d/3d)
marks the parameters of those module classes (exact class, as DeepSpeed matches) with a ``comm_dtype``
attribute, DeepSpeed's marker for "this gradient may be reduced in the autocast dtype". shardwise
reduces every gradient in ``communication_data_type`` (fp32 by default) all the same: see
docs/config.md.
"""

from __future__ import annotations

import contextlib
import importlib

import torch

__all__ = ["DTYPES", "COMM_DTYPE_ATTR", "safe_module_classes", "mark_lower_precision_params", "autocast"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
COMM_DTYPE_ATTR = "comm_dtype"  # DeepSpeed's attribute name (deepspeed.runtime.torch_autocast)


def safe_module_classes(names: list[str]) -> list[type]:
    """Import each ``package.Class`` name; a name that does not import is a config error naming it."""
    out = []
    for name in names:
        package, _, cls_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(package), cls_name) if package else None
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"torch_autocast.lower_precision_safe_modules: cannot import {name!r} ({exc})") from None
        if not isinstance(cls, type) or not issubclass(cls, torch.nn.Module):
            raise ValueError(f"torch_autocast.lower_precision_safe_modules: {name!r} is not a torch.nn.Module "
                             "class (write the dotted path, e.g. torch.nn.Linear)")
        out.append(cls)
    return out


def mark_lower_precision_params(module: torch.nn.Module, dtype: torch.dtype, names: list[str]) -> int:
    """Give the parameters of the listed module classes DeepSpeed's ``comm_dtype`` marker; returns how many."""
    classes = tuple(safe_module_classes(names))
    marked = 0
    for m in module.modules():
        if type(m) in classes:
            for p in m.parameters(recurse=False):
                setattr(p, COMM_DTYPE_ATTR, dtype)
                marked += 1
    return marked


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` for the engine's forward (``dtype`` None: no autocast, a null context).
    The block's dtype wins over an autocast the caller already opened, as in DeepSpeed."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
