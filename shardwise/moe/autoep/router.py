"""Token-choice top-k routing from a Hugging Face router's logits, as the model computes it.

* ``softmax`` scores (Mixtral, Qwen, DeepSeek-V2) or ``sigmoid`` scores (DeepSeek-V3), in fp32;
* the experts are chosen on ``scores + bias`` (DeepSeek-V3's ``e_score_correction_bias``, or the
  auxiliary-loss-free balancing bias), the weights are the unbiased scores of the chosen experts;
* group-limited routing: the experts are cut into ``num_expert_groups`` groups, a group scores its best
  expert (``max``, DeepSeek-V2) or the sum of its best two (``top2_sum``, DeepSeek-V3), and only the
  best ``num_limited_groups`` groups are chosen from;
* ``route_norm``: the k weights divided by their sum (plus ``norm_eps``); then times ``route_scale``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from shardwise.moe.autoep.presets import LayerSpec


def route(logits: Tensor, spec: LayerSpec, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(weights [tokens, k], experts [tokens, k])`` for ``logits [tokens, experts]``."""
    scores = logits.float().softmax(dim=-1) if spec.score_func == "softmax" else logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    if spec.num_expert_groups is not None and spec.num_expert_groups > 1:
        choice = _keep_best_groups(choice, spec)
    experts = torch.topk(choice, spec.top_k, dim=-1)[1]
    weights = scores.gather(1, experts)
    if spec.route_norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + spec.norm_eps)
    if spec.route_scale != 1.0:
        weights = weights * spec.route_scale
    if spec.cast_scores:
        weights = weights.to(logits.dtype)
    return weights, experts


def _keep_best_groups(choice: Tensor, spec: LayerSpec) -> Tensor:
    tokens, n = choice.shape
    grouped = choice.view(tokens, spec.num_expert_groups, n // spec.num_expert_groups)
    if spec.group_score == "max":
        group_scores = grouped.max(dim=-1).values
    else:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, spec.num_limited_groups, dim=-1)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(tokens, n)


def bias_update(counts: Tensor, coeff: float) -> Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded experts and lower the
    bias of over-loaded ones by ``coeff`` (``counts``: routes per expert over the whole data axis)."""
    counts = counts.float()
    return coeff * torch.sign(counts.mean() - counts)
