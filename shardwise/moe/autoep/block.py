"""``AutoEPMoE``: the expert-parallel block that replaces a Hugging Face MoE block.

It keeps the block's own router module (``gate``: same parameters, same state-dict names, and Hugging
Face's ``output_router_logits`` recorder still sees its logits) and shared experts, and holds this rank's
``num_experts / ep_size`` experts as ``experts.{j}.{gate,up,down}`` weights (Mixtral: ``w1, w3, w2``): the
per-expert layout of the models' published checkpoints. Local expert j of expert-parallel rank r is global
expert ``r * num_local_experts + j``. Expert parameters carry DeepSpeed's tags (``allreduce = False``,
``group_name = "ep_size_N"``), so the engine reduces them over their expert-data-parallel group.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardwise import comm
from shardwise.comm.autograd import all_to_all
from shardwise.param_attrs import add_external_param
from shardwise.moe.autoep import dispatch
from shardwise.moe.autoep.presets import LayerSpec
from shardwise.moe.autoep.router import bias_update, route


class Expert(nn.Module):
    """One expert's three projection weights, under the names the model's checkpoints use."""

    def __init__(self, names: tuple[str, str, str], gate: Tensor, up: Tensor, down: Tensor) -> None:
        super().__init__()
        self.names = names
        for name, w in zip(names, (gate, up, down)):
            layer = nn.Module()
            layer.weight = nn.Parameter(w.detach().clone(), requires_grad=w.requires_grad)
            self.add_module(name, layer)

    def weights(self) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(getattr(self, n).weight for n in self.names)


class AutoEPMoE(nn.Module):
    local_experts_path = "experts"  # where shardwise.moe.parallel finds the local expert list

    def __init__(self, block: nn.Module, spec: LayerSpec, *, ep_size: int, ep_rank: int,
                 use_grouped_mm: bool = True, load_balance_coeff: float | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.ep_size, self.num_experts = ep_size, spec.num_experts
        self.num_local_experts = spec.num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_grouped_mm = use_grouped_mm
        self.load_balance_coeff = load_balance_coeff
        self.gate = block.gate
        self.act_fn = block.experts.act_fn
        if spec.shared:
            setattr(self, spec.shared, getattr(block, spec.shared))
        if spec.shared_gate:
            setattr(self, spec.shared_gate, getattr(block, spec.shared_gate))
        first = ep_rank * self.num_local_experts
        fused_up, fused_down = block.experts.gate_up_proj, block.experts.down_proj
        experts = []
        for g in range(first, first + self.num_local_experts):
            gate_w, up_w = fused_up[g].chunk(2, dim=0)
            experts.append(Expert(spec.weight_names, gate_w, up_w, fused_down[g]))
        self.experts = nn.ModuleList(experts)
        for p in self.experts.parameters():
            p.allreduce = False
            p.group_name = self.expert_group_name
            add_external_param(self, p)  # read in this block's forward (ZeRO-3 gathers them around it)
        if load_balance_coeff and not _has_correction_bias(self.gate):  # softmax models: a bias of our own
            self.register_buffer("expert_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
        self.register_buffer("_pending_counts", torch.zeros(spec.num_experts, dtype=torch.long), persistent=False)
        self.ep_group = self.dp_group = None

    # -- engine hooks ------------------------------------------------------------------------------
    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Take this block's expert groups from the active grid (created there on first use, collective)."""
        from shardwise.topology import active_grid, expert_groups

        grid = active_grid()  # the engine's grid (its groups of this ep_size; created there on first use)
        self.expert_groups = expert_groups(self.ep_size, data_before_expert=use_data_before_expert_parallel_)
        self.ep_group = self.expert_groups.group
        self.dp_group = grid.group("data") if grid is not None else None

    # -- forward -----------------------------------------------------------------------------------
    def forward(self, hidden_states: Tensor) -> Tensor:
        shape = hidden_states.shape
        if self.training and self.spec.jitter > 0:  # Mixtral's router jitter, drawn as the model draws it
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(
                1.0 - self.spec.jitter, 1.0 + self.spec.jitter)
        x = hidden_states.reshape(-1, shape[-1])
        balancing = self.training and bool(self.load_balance_coeff)
        logits = self.gate(x)[0]  # the model's router: Hugging Face records these for the auxiliary loss
        weights, experts = route(logits, self.spec, self._selection_bias())
        if balancing:
            self._pending_counts += torch.bincount(experts.reshape(-1), minlength=self.num_experts)
        out = self._experts(x, weights, experts).to(x.dtype)
        if self.spec.shared:
            shared = getattr(self, self.spec.shared)(x)
            if self.spec.shared_gate:
                shared = torch.sigmoid(getattr(self, self.spec.shared_gate)(x)) * shared
            out = out + shared
        return out.reshape(shape)

    def _experts(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """Each token's routes, computed where their experts live, summed in expert order."""
        k = experts.shape[1]
        experts, order_k = experts.sort(dim=1)  # (the model sums a token's routes in expert order)
        weights = weights.gather(1, order_k)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = x.index_select(0, order // k)
        if self.spec.score_apply == "pre":
            rows = (rows.float() * weights.reshape(-1)[order].unsqueeze(1)).to(rows.dtype)
        counts = torch.bincount(flat, minlength=self.num_experts)
        w13, w2 = self._stacked()
        if self.ep_size == 1:
            y = dispatch.run_experts(rows, counts.tolist(), w13, w2, self.act_fn, grouped=self.use_grouped_mm)
        else:
            y = self._exchange(rows, counts, w13, w2)
        routed = torch.empty_like(y).index_copy_(0, order, y).view(-1, k, y.shape[-1])
        out = torch.zeros_like(x)
        for j in range(k):
            part = routed[:, j] if self.spec.score_apply == "pre" else routed[:, j] * weights[:, j:j + 1]
            out = out + part.to(out.dtype)
        return out

    def _exchange(self, rows: Tensor, counts: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
        if self.ep_group is None:
            raise RuntimeError("AutoEP block with autoep_size > 1 has no expert-parallel group: train it "
                               "through shardwise.initialize")
        received = dispatch.exchange_counts(counts, ep_size=self.ep_size, group=self.ep_group)
        send = counts.view(self.ep_size, -1).sum(dim=1).tolist()
        recv = received.sum(dim=1).tolist()
        got = all_to_all(rows, group=self.ep_group, send=send, recv=recv)
        ids = dispatch.expert_ids_of(received)
        by_expert = torch.argsort(ids, stable=True)
        y = dispatch.run_experts(got.index_select(0, by_expert), received.sum(dim=0).tolist(), w13, w2,
                                 self.act_fn, grouped=self.use_grouped_mm)
        y = torch.empty_like(y).index_copy_(0, by_expert, y)
        return all_to_all(y, group=self.ep_group, send=recv, recv=send)

    def _stacked(self) -> tuple[Tensor, Tensor]:
        """``[local, 2 x inter, hidden]`` (gate rows then up rows, the model's fused layout) and
        ``[local, hidden, inter]``."""
        ws = [e.weights() for e in self.experts]
        w13 = torch.stack([torch.cat([g, u]) for g, u, _ in ws])
        return w13, torch.stack([d for _, _, d in ws])

    # -- auxiliary-loss-free balancing ---------------------------------------------------------------
    def _selection_bias(self) -> Tensor | None:
        bias = getattr(self.gate, "e_score_correction_bias", None)
        return bias if bias is not None else getattr(self, "expert_bias", None)

    @torch.no_grad()
    def move_bias(self) -> None:
        """After an optimizer step (the engine calls it, on every rank): move the bias by the routes counted
        since the last step, summed over the data axis (so every rank moves it the same way). Collective."""
        counts = self._pending_counts.clone()
        if comm.is_initialized():
            comm.all_reduce(counts, group=self.dp_group)
        if counts.sum() > 0:
            self._selection_bias().add_(bias_update(counts, self.load_balance_coeff))
        self._pending_counts.zero_()


def _has_correction_bias(gate: nn.Module) -> bool:
    return getattr(gate, "e_score_correction_bias", None) is not None


def balancing_blocks(module: nn.Module) -> list[AutoEPMoE]:
    """The AutoEP blocks whose bias moves after each optimizer step (``load_balance_coeff`` set)."""
    return [m for m in module.modules() if isinstance(m, AutoEPMoE) and m.load_balance_coeff]
