"""``UlyssesSPViTAttention``: sequence parallelism around a vision encoder's attention.

A ViT's attention is not causal, so a rank cannot attend over its own patches alone. The wrapper keeps
everything outside attention sharded (each rank holds a contiguous slice of the patches) and, around
the wrapped attention, gathers the whole patch sequence, runs the attention on it unchanged and keeps
this rank's slice of the result. Slices may differ in length; padding never reaches the attention.
A CLS token, when the model has one, is the first token on every rank (replicated, not sharded).

Gradients: the gather is differentiable, so each rank's input receives the gradients that every rank's
output slice sends to its patches. The wrapped attention's weights get, on each rank, the gradient
of that rank's slice; summed over the group (what data-parallel gradient reduction does) they are
the gradient of the whole sequence. The CLS output is the same on every rank: count its loss once
over the group.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.sequence.autosp._gather import gather_sequence


class UlyssesSPViTAttention(torch.nn.Module):
    """Wraps ``attn`` (called as ``attn(hidden_states, **kwargs)``, returning a tensor or a tuple whose
    first item is the output). ``hidden_states`` is ``[batch, local_tokens, hidden]``: this rank's
    patches, after the CLS token when ``has_cls_token``."""

    def __init__(self, attn: torch.nn.Module, process_group, has_cls_token: bool = True) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.has_cls_token = has_cls_token

    def forward(self, hidden_states: torch.Tensor, **kwargs):
        if hidden_states.dim() < 2 or (self.has_cls_token and hidden_states.shape[1] == 0):
            raise ValueError(f"UlyssesSPViTAttention: hidden_states of shape {tuple(hidden_states.shape)}: expected "
                             "[batch, tokens, ...]" + (" with the CLS token first" if self.has_cls_token else ""))
        skip = 1 if self.has_cls_token else 0
        cls, patches = hidden_states[:, :skip], hidden_states[:, skip:]
        full, lens = gather_sequence(patches, self.process_group, dim=1)
        out = self.attn(torch.cat([cls, full], dim=1) if skip else full, **kwargs)
        many = isinstance(out, (tuple, list))
        first = out[0] if many else out
        start = skip + sum(lens[:comm.get_rank(self.process_group)])
        mine = first[:, start:start + patches.shape[1]]
        if skip:
            mine = torch.cat([first[:, :skip], mine], dim=1)
        mine = mine.contiguous()
        return (mine, *out[1:]) if many else mine  # the wrapped module's tuple, its first item replaced
