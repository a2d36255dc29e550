"""DeepSpeed's gates (top-1, top-2, top-k with capacity and token dropping) and ``MOELayer``.

A gate returns its routes as ``(l_aux, capacity, num_experts, indices, locations, weights, exp_counts)``:
``indices``/``locations``/``weights`` are ``[k, tokens]``: the expert of each of a token's k routes
(-1 where the capacity dropped it), its slot in that expert's buffer, and its combine weight. The
random draws (Gumbel noise, random token selection, jitter) are taken in DeepSpeed's order from the
same torch distributions, so a script seeded alike routes alike.

``MOELayer`` packs the tokens into an ``[experts, capacity, hidden]`` buffer, exchanges it with an
all-to-all over the expert-parallel group (each rank keeps the rows of its local experts, from every
rank), runs the local experts, exchanges back and combines. Every rank takes part in both
all-to-alls whatever it routed, so a rank whose experts get no tokens does not stall the others.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwise import comm
from shardwise.comm.autograd import all_to_all
from shardwise.param_attrs import set_z3_leaf
from shardwise.tensor_parallel.mappings import gather_from_sequence_parallel_region, scatter_to_sequence_parallel_region

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


# -- random draws (DeepSpeed's distributions) -------------------------------------------------------
def _uniform(shape, device, low=0.0, high=1.0) -> Tensor:
    return torch.distributions.uniform.Uniform(torch.tensor(low, device=device),
                                               torch.tensor(high, device=device)).rsample(shape)


def gumbel_rsample(shape, device) -> Tensor:
    return torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=device),
                                             torch.tensor(1.0, device=device)).rsample(shape)


def multiplicative_jitter(x: Tensor, device, epsilon: float = 1e-2) -> Tensor:
    """``x`` times a uniform draw from [1 - epsilon, 1 + epsilon] (the 'Jitter' noisy gate policy)."""
    return x if epsilon == 0 else x * _uniform(x.shape, device, 1.0 - epsilon, 1.0 + epsilon)


# -- capacity ------------------------------------------------------------------------------------
def _capacity(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    return max(math.ceil(num_tokens / num_experts * capacity_factor), min_capacity)


def _dropless_capacity(exp_counts: Tensor, ep_group) -> int:
    """No token dropped: the largest expert load, agreed over the expert-parallel group (the all-to-all
    needs one buffer size on every rank)."""
    cap = exp_counts.max().clone()
    if ep_group is not None and comm.get_world_size(ep_group) > 1:
        comm.all_reduce(cap, op=torch.distributed.ReduceOp.MAX, group=ep_group)
    return int(cap)


# -- gates -----------------------------------------------------------------------------------------
def top1gating(logits: Tensor, capacity_factor: float, min_capacity: int, used_token: Tensor | None = None,
               noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
               ep_group=None):
    """Switch-style top-1 routing; the combine weight is the softmax probability (not renormalised)."""
    noisy = logits + gumbel_rsample(logits.shape, logits.device) if noisy_gate_policy == "RSample" else None
    gates = F.softmax(logits, dim=1)
    tokens, num_experts = gates.shape
    capacity = _capacity(tokens, num_experts, capacity_factor, min_capacity)
    index = torch.argmax(noisy if noisy is not None else gates, dim=1)
    mask = F.one_hot(index, num_classes=num_experts)
    if used_token is not None:
        mask = used_token.unsqueeze(1) * mask
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = min(_dropless_capacity(exp_counts, ep_group), tokens)
    l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts
    ranked = mask * _uniform(mask.shape, logits.device) if use_rts else mask  # random token selection
    if tokens < min_capacity:
        raise ValueError(f"MoE top-1 gate: {tokens} tokens is fewer than min_capacity {min_capacity}: set "
                         "min_capacity lower or feed more tokens per step")
    keep = torch.topk(ranked, k=min(capacity, tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, keep, 1)
    kept = mask.sum(dim=1) > 0
    index = torch.where(kept, index, torch.full_like(index, -1))
    locations = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
    weights = (gates * mask).sum(dim=1)
    return l_aux, capacity, num_experts, index.unsqueeze(0), locations.unsqueeze(0), weights.unsqueeze(0), exp_counts


def top2gating(logits: Tensor, capacity_factor: float, min_capacity: int, drop_tokens: bool = True, ep_group=None,
               top2_2nd_expert_sampling: bool = True):
    """GShard top-2 routing: the second expert picked after Gumbel noise (unless switched off), the two
    weights renormalised to sum to one; the capacity is per expert, ``2 x capacity_factor``."""
    gates = F.softmax(logits, dim=1)
    tokens, num_experts = gates.shape
    index1 = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(index1, num_classes=num_experts)
    if top2_2nd_expert_sampling:
        logits = logits + gumbel_rsample(logits.shape, logits.device)
    index2 = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(index2, num_classes=num_experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)  # second routes queue after the first
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()
    if drop_tokens:
        capacity = _capacity(tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * torch.lt(loc1, capacity)
        mask2 = mask2 * torch.lt(loc2, capacity)
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)
    loc1_s = torch.sum(loc1 * mask1, dim=1)
    loc2_s = torch.sum(loc2 * mask2, dim=1)
    g1 = torch.einsum("se,se->s", gates, mask1.float())
    g2 = torch.einsum("se,se->s", gates, mask2.float())
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    g1, g2 = g1 / denom, g2 / denom
    index1 = torch.where(mask1.any(dim=1), index1, torch.full_like(index1, -1))
    index2 = torch.where(mask2.any(dim=1), index2, torch.full_like(index2, -1))
    return (l_aux, capacity, num_experts, torch.stack([index1, index2]), torch.stack([loc1_s, loc2_s]),
            torch.stack([g1, g2]), exp_counts)


def topkgating(logits: Tensor, k: int, capacity_factor: float, min_capacity: int, drop_tokens: bool = True,
               ep_group=None, drop_policy: str = "probs"):
    """Top-k routing (k > 2): weights renormalised over the kept routes; with dropping, an expert keeps
    its ``capacity`` most probable tokens (``drop_policy`` 'probs') or its first ones ('position')."""
    gates = F.softmax(logits, dim=1)
    tokens, num_experts = gates.shape
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = torch.mean(gates.mean(dim=0) * mask.float().mean(dim=0)) * num_experts * num_experts / k
    if drop_tokens:
        capacity = _capacity(tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            ranked = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            keep = torch.topk(ranked, k=min(capacity, tokens), dim=0, sorted=False)[1]
            mask &= torch.zeros_like(gates, dtype=torch.bool).scatter_(0, keep, True)
            locations = torch.cumsum(mask, dim=0) - 1
        elif drop_policy == "position":
            locations = torch.cumsum(mask, dim=0) - 1
            mask = mask * torch.lt(locations, capacity)
        else:
            raise ValueError(f"drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    else:
        capacity = _dropless_capacity(exp_counts, ep_group)
        locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(dim=-1, keepdim=True), min=torch.finfo(masked.dtype).eps)
    kept = mask.gather(1, top_idx).bool()
    index = torch.where(kept, top_idx, torch.full_like(top_idx, -1))
    loc = locations.gather(1, top_idx) * kept
    return (l_aux, capacity, num_experts, index.t().contiguous(), loc.t().contiguous(),
            masked.gather(1, top_idx).t().contiguous(), exp_counts)


class TopKGate(nn.Module):
    """The router: a bias-free linear layer to one logit per expert (computed in fp32), then the gate."""

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8, noisy_gate_policy: str | None = None,
                 drop_tokens: bool = True, use_rts: bool = True, ep_group=None,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if k < 1 or k > num_experts:
            raise ValueError(f"MoE k={k}: must be between 1 and num_experts={num_experts}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"MoE noisy_gate_policy={noisy_gate_policy!r}: must be one of 'None', 'Jitter', 'RSample'")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        set_z3_leaf(self, True)  # forward reads wg.weight without calling wg: ZeRO-3 gathers it on the gate's entry
        self.ep_group = ep_group
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.top2_2nd_expert_sampling = drop_tokens, use_rts, top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, input: Tensor, used_token: Tensor | None = None):
        x = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=input.device)
        logits = F.linear(x, self.wg.weight.float())
        cf = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(logits, cf, self.min_capacity, used_token,
                              self.noisy_gate_policy if self.training else None, self.drop_tokens, self.use_rts,
                              self.ep_group)
        if self.k == 2:
            return top2gating(logits, cf, self.min_capacity, self.drop_tokens, self.ep_group,
                              self.top2_2nd_expert_sampling)
        return topkgating(logits, self.k, cf, self.min_capacity, self.drop_tokens, self.ep_group)


# -- the exchange ------------------------------------------------------------------------------------
def all_to_all_bytes(*, hidden: int, num_experts: int, capacity: int, element_bytes: int) -> int:
    """Bytes one rank hands to ``all_to_all_single`` per MoE layer and training step: two exchanges forward
    and two backward, each of the whole ``[experts, capacity, hidden]`` buffer (the ``1 / ep_size`` of it
    bound for the rank itself included; the rest crosses to the other ranks)."""
    return 4 * num_experts * capacity * hidden * element_bytes


class MOELayer(nn.Module):
    def __init__(self, gate: TopKGate, experts: nn.Module, ep_group_name: str, ep_size: int,
                 num_local_experts: int) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts
        self.ep_group = None
        self.ep_group_name, self.ep_size, self.num_local_experts = ep_group_name, ep_size, num_local_experts
        self.tp_group, self.tp_size = None, 1
        self.l_aux = self.exp_counts = self.last_capacity = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _set_tp_group(self, tp_group, tp_size: int) -> None:
        """Under tensor parallelism the tokens are the same on every tensor rank: each rank sends its
        ``1 / tp_size`` of every expert's slots, and the expert outputs are all-gathered back (DeepSpeed's
        ``drop_tokens`` / ``gather_tokens``)."""
        self.tp_group, self.tp_size = tp_group, tp_size

    def forward(self, *input: Tensor, **kwargs) -> Tensor:
        hidden = input[0].shape[-1]
        x = input[0].reshape(-1, hidden)
        used_token = input[1] if len(input) > 1 else None
        self.l_aux, capacity, num_experts, index, locations, weights, self.exp_counts = self.gate(x, used_token)
        capacity = int(capacity)
        capacity = self.last_capacity = -(-capacity // self.tp_size) * self.tp_size  # (the all-to-all buffer size)
        slots = torch.where(index >= 0, index.long() * capacity + locations.long(),
                            torch.full_like(index, num_experts * capacity, dtype=torch.long))
        dispatched = _encode(x, slots, num_experts * capacity).view(num_experts, capacity, hidden)
        if self.tp_size > 1:  # this tensor rank's share of every expert's slots (backward: all-gathered)
            dispatched = scatter_to_sequence_parallel_region(dispatched, self.tp_group, dim=1)
        if self.ep_size > 1:
            if self.ep_group is None:
                raise RuntimeError(f"MoE layer with ep_size {self.ep_size} has no expert-parallel group: "
                                   "train it through shardwise.initialize (or call set_deepspeed_parallelism())")
            dispatched = all_to_all(dispatched, group=self.ep_group)
        out = self.experts(dispatched.reshape(self.ep_size, self.num_local_experts, -1, hidden))
        out = out.reshape(num_experts, -1, hidden)
        if self.ep_size > 1:
            out = all_to_all(out, group=self.ep_group)
        if self.tp_size > 1:  # every tensor rank's slots again (backward: this rank's share of the gradient)
            out = gather_from_sequence_parallel_region(out.reshape(num_experts, -1, hidden), self.tp_group, dim=1,
                                                       tensor_parallel_output_grad=False)
        return _decode(out.reshape(num_experts * capacity, hidden), slots, weights).reshape(input[0].shape)


def _encode(x: Tensor, slots: Tensor, nslots: int) -> Tensor:
    """``[nslots, hidden]``: the token routed to each slot (zeros where none is)."""
    tokens = x.shape[0]
    source = torch.full((nslots + 1,), tokens, dtype=torch.long, device=x.device)
    source.scatter_(0, slots.reshape(-1), torch.arange(tokens, device=x.device).expand_as(slots).reshape(-1))
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, source[:-1])


def _decode(out: Tensor, slots: Tensor, weights: Tensor) -> Tensor:
    """Each token's expert outputs, weighted (in fp32) and summed over its routes."""
    padded = torch.cat([out, out.new_zeros(1, out.shape[1])])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], slots.shape[1], out.shape[1])
    return (routed * weights.unsqueeze(-1)).sum(0).to(out.dtype)
