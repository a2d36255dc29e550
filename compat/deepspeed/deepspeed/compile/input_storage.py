"""Keeps a compiled graph's example inputs as tensor descriptions (shape, dtype, strides, device, ...) so
they can be rebuilt later without holding the real tensors; optionally the data too (integer tensors,
or all tensors)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

_INT_DTYPES = frozenset(d for d in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                                    getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                                    getattr(torch, "uint64", None)) if d is not None)


@dataclass
class TensorMetadata:
    """What :class:`InputStorage` keeps of one tensor (``real_data``: a CPU copy, when asked to keep it)."""
    shape: Tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    stride: Tuple[int, ...]
    storage_offset: int
    requires_grad: bool
    layout: torch.layout
    memory_format: torch.memory_format = torch.contiguous_format
    real_data: Optional[torch.Tensor] = None


class InputStorage:
    """One set of inputs, stored by :meth:`put` and rebuilt by :meth:`get` (tensors come back with the
    stored shape, dtype, strides, device and ``requires_grad``; their values are ones unless the data
    was kept: ``keep_int_input_tensors`` keeps integer/bool tensors, ``keep_all_input_tensors`` all)."""

    def __init__(self, keep_int_input_tensors: bool = False, keep_all_input_tensors: bool = False):
        self._stored_inputs: Any = None
        self._has_data = False
        self._keep_int_input_tensors = keep_int_input_tensors
        self._keep_all_input_tensors = keep_all_input_tensors

    def _is_int_tensor(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in _INT_DTYPES

    def _extract_tensor_metadata(self, tensor: torch.Tensor) -> TensorMetadata:
        keep = self._keep_all_input_tensors or (self._keep_int_input_tensors and self._is_int_tensor(tensor))
        return TensorMetadata(shape=tuple(tensor.shape), dtype=tensor.dtype, device=tensor.device,
                              stride=tuple(tensor.stride()), storage_offset=tensor.storage_offset(),
                              requires_grad=tensor.requires_grad, layout=tensor.layout,
                              real_data=tensor.detach().cpu() if keep else None)

    def _store_value(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return self._extract_tensor_metadata(value)
        if isinstance(value, tuple):
            return tuple(self._store_value(v) for v in value)
        if isinstance(value, list):
            return [self._store_value(v) for v in value]
        if isinstance(value, dict):
            return {k: self._store_value(v) for k, v in value.items()}
        return value

    @staticmethod
    def _rebuild(meta: TensorMetadata) -> torch.Tensor:
        if meta.real_data is not None:
            t = meta.real_data.clone()
        else:
            t = torch.ones(meta.shape, dtype=meta.dtype, layout=meta.layout, device="cpu")
        if len(meta.shape) > 0 and tuple(t.stride()) != tuple(meta.stride):
            try:
                t = torch.as_strided(t, meta.shape, meta.stride, meta.storage_offset)
            except RuntimeError:
                pass  # strides that do not fit the new storage: keep the contiguous tensor
        t = t.to(device=meta.device)
        if meta.requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t

    def _materialize_value(self, stored: Any) -> Any:
        if isinstance(stored, TensorMetadata):
            return self._rebuild(stored)
        if isinstance(stored, tuple):
            return tuple(self._materialize_value(v) for v in stored)
        if isinstance(stored, list):
            return [self._materialize_value(v) for v in stored]
        if isinstance(stored, dict):
            return {k: self._materialize_value(v) for k, v in stored.items()}
        return stored

    def put(self, real_inputs: Any) -> None:
        """Store ``real_inputs`` (tensors, nested lists/tuples/dicts of them, other values kept as is)."""
        self._stored_inputs = self._store_value(real_inputs)
        self._has_data = True

    def get(self) -> Any:
        """Fresh tensors built from what :meth:`put` stored; ``RuntimeError`` when nothing was stored."""
        if not self._has_data:
            raise RuntimeError("InputStorage.get(): no inputs were stored (call put() first)")
        return self._materialize_value(self._stored_inputs)

    def has_data(self) -> bool:
        return self._has_data

    def clear(self) -> None:
        self._stored_inputs = None
        self._has_data = False
