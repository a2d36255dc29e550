"""ZeRO strategies for optimizers that exchange compressed momentum themselves (1-bit Adam, 0/1 Adam,
1-bit LAMB: ``compressed_communication``; docs/onebit.md). ``zero/factory.py`` picks them.

Each is stage 0 or stage 1 plus three things the variant owns, so the engine sees only the strategy
interface:

* before each backward it asks the optimizer whether this backward reduces gradients
  (``needs_gradient_allreduce``: warm-up steps do, in full precision; afterwards each rank keeps its
  own local gradients and the optimizer exchanges compressed momentum);
* with local gradients the norm is this rank's own (``norm_is_local``; clipping uses the local
  norm, as in DeepSpeed), and whether a step overflowed is agreed by one small all-reduce of a flag
  (``overflow_anywhere``), so every rank skips together instead of one rank leaving the exchange;
* at stage 1 (OneBitAdam) the step after warm-up is ``optim/onebit/zero1.py``'s ``Zero1Exchange``,
  which runs stage 0's arithmetic on the partitioned state; the strategy then writes the updated
  fp32 master pieces back and all-gathers the weights.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.precision import grad_sq_sum
from shardwise.zero.stage0 import DataParallelStrategy
from shardwise.zero.stage12 import Stage1Strategy


class _CompressedExchange:
    """What both variants add to their stage (see the module docstring)."""

    can_keep_local_gradients = True

    def prepare_backward(self, *, boundary: bool, no_sync: bool = False) -> None:
        self.reduce_gradients = self.optimizer.needs_gradient_allreduce
        super().prepare_backward(boundary=boundary, no_sync=no_sync)

    @property
    def norm_is_local(self) -> bool:
        return self.replicated or not self.reduce_gradients

    def overflow_anywhere(self, overflow: bool) -> bool:
        """With local gradients one rank may see an inf/NaN the others do not: a flag, all-reduced."""
        if self.reduce_gradients or self.dp_world_size == 1:
            return overflow
        flag = torch.tensor([1.0 if overflow else 0.0], dtype=torch.float32, device=self.groups[0].device)
        comm.all_reduce(flag, op=comm.ReduceOp.MAX, group=self.dp_group)
        return bool(flag.item())


class CompressedDataParallelStrategy(_CompressedExchange, DataParallelStrategy):
    """Stage 0 for a compressed-communication optimizer: its ``step`` exchanges what it needs."""

    def __init__(self, *, optimizer, dp_group=None, **kwargs) -> None:
        optimizer.bind_group(dp_group)
        super().__init__(optimizer=optimizer, dp_group=dp_group, **kwargs)


class CompressedStage1Strategy(_CompressedExchange, Stage1Strategy):
    """Stage 1 for OneBitAdam: warm-up is ordinary stage 1; afterwards ``Zero1Exchange`` steps."""

    def __init__(self, *, optimizer, dp_group=None, **kwargs) -> None:
        from shardwise.optim.onebit.zero1 import Zero1Exchange

        optimizer.bind_group(dp_group)
        # stage 0's parameter order, before the partitioned step replaces the parameters by fragments
        order = [[id(p) for p in g["params"]] for g in optimizer.param_groups]
        super().__init__(optimizer=optimizer, dp_group=dp_group, **kwargs)
        self.exchange = Zero1Exchange(optimizer, groups=self.groups, fragments=self.fragments,
                                      dp_group=self.dp_group, order=order,
                                      separate_master=self.partition.separate_master)

    def local_grad_norm_sq(self, *, counted=None) -> torch.Tensor:
        if self.reduce_gradients:
            return super().local_grad_norm_sq(counted=counted)
        # whole local gradients: every element of this rank's own gradient, as at stage 0
        if counted is None:
            return grad_sq_sum(self.gradients.buffers)
        return grad_sq_sum([v for g, views in zip(self.groups, self.gradients.views)
                            for name, v in zip(g.names, views) if counted(name)])

    def apply_step(self, *, coef: float, coef_fixed: bool = False) -> None:
        if self.reduce_gradients:
            super().apply_step(coef=coef, coef_fixed=coef_fixed)
            return
        self.exchange.step(self.gradients.buffers, coef=coef)
        if self.partition.separate_master:  # fp16/bf16: the fp32 master pieces moved; spread the weights
            for frags in self.fragments:
                for f in frags:
                    self.weight_of(f).copy_(f.tensor.detach().reshape(-1))
            self._all_gather_params()
