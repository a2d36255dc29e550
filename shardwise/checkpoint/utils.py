"""``deepspeed.checkpoint.utils``: the helper accelerate calls before ``torch.save`` of a state dict."""

from __future__ import annotations

import torch


def clone_tensors_for_torch_save(item, device: torch.device = torch.device("cpu")):
    """A copy of ``item`` (tensors, or lists/tuples/dicts of them) whose tensors are cloned to ``device``,
    so a saved tensor holds only its own elements, not the whole storage a view points into."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
