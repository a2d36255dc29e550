"""Device and backend choice, in one place and device-agnostic."""

from __future__ import annotations

import os

import torch


def _accelerator_type() -> str | None:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        return acc.current_accelerator().type
    if torch.cuda.is_available():
        return "cuda"
    return None


def get_accelerator_device(local_rank: int | None = None) -> torch.device:
    """The device this rank computes on: ``<accelerator>:<local_rank>`` or ``cpu``."""
    kind = _accelerator_type()
    if kind is None:
        return torch.device("cpu")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(kind, local_rank)


def default_backend() -> str:
    """nccl (or the accelerator's own backend) with an accelerator, gloo on CPU."""
    kind = _accelerator_type()
    return {"cuda": "nccl", "xpu": "xccl", "hpu": "hccl"}.get(kind or "", "gloo")
