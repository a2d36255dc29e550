"""The dtypes the engine gives a model's parameters and buffers under fp16/bf16 (``data_types`` block).

Parameters train in the fp16/bf16 dtype (the trainable ones are cast by the ZeRO strategy, the frozen
ones by the engine). Buffers keep the dtype the model was built with unless ``data_types.buffer_dtype``
names one, as DeepSpeed 0.19.8 and FSDP do: a rotary ``inv_freq`` or a routing bias rounded to bf16
changes the model's output. Buffers named by ``data_types.keep_in_fp32_modules`` stay in (or return to)
fp32 in every case.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

__all__ = ["CASTABLE", "cast_parameters", "cast_buffers", "keep_in_fp32_pattern"]

CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fp8 and integer tensors stay


def cast_parameters(params: Iterable[torch.nn.Parameter], dtype: torch.dtype) -> None:
    for p in params:
        if p.dtype in CASTABLE and p.dtype != dtype:
            p.data = p.data.to(dtype)


def cast_buffers(module: torch.nn.Module, dtype: torch.dtype | None, *, keep_fp32: re.Pattern | None = None) -> None:
    """Cast the floating buffers of ``module`` to ``dtype`` (None: leave them), and the ones whose full
    names ``keep_fp32`` matches to fp32 instead."""
    for name, b in module.named_buffers():
        if b is None or b.dtype not in CASTABLE:
            continue
        target = torch.float32 if keep_fp32 is not None and keep_fp32.search(name) else dtype
        if target is not None and b.dtype != target:
            b.data = b.data.to(target)


def keep_in_fp32_pattern(module: torch.nn.Module, setting: str | list[str], dtype: torch.dtype) -> re.Pattern | None:
    """The buffer names to keep in fp32 when training in ``dtype``, as one pattern (None: none, or fp32 training).

    ``setting`` is ``"auto"`` (the names in the model's ``_keep_in_fp32_modules_strict``, and under fp16 its
    ``_keep_in_fp32_modules`` too: Hugging Face transformers' lists, relative to the module that declares them)
    or a list of name patterns where ``*`` stands for any text, found anywhere in a buffer's full name.
    """
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if setting == "auto":
        patterns = set()
        for prefix, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or ())
            for n in names:
                body = n.replace("*", ".*")  # under a submodule: anywhere below it
                patterns.add("^" + re.escape(prefix + ".") + ".*" + body if prefix else body)
    else:
        patterns = {n.replace("*", ".*") for n in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None
