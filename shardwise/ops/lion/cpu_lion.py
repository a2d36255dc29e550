"""``deepspeed.ops.lion.cpu_lion.DeepSpeedCPULion`` on the chunked Lion update."""

from __future__ import annotations

import torch

from shardwise.optim.adam import _DeviceCheck
from shardwise.optim.lion import Lion


class DeepSpeedCPULion(_DeviceCheck, Lion):
    """Lion for CPU parameters with DeepSpeed's arguments.

    ``fp32_optimizer_states`` (default true) keeps the momentum in fp32 whatever the
    parameter dtype; the chunk is then computed in fp32 and rounded once into the
    parameter.
    """

    optimizer_id = 0
    _cpu_only = True
    _label = "DeepSpeedCPULion"

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fp32_optimizer_states = fp32_optimizer_states
        self.opt_id = DeepSpeedCPULion.optimizer_id
        DeepSpeedCPULion.optimizer_id += 1

    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else p.dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._check_device(p)
        return super().step(closure)
