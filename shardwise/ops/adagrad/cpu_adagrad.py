"""``deepspeed.ops.adagrad.cpu_adagrad.DeepSpeedCPUAdagrad`` on torch's fused CPU Adagrad kernel."""

from __future__ import annotations

from shardwise.optim.adam import Adagrad


class DeepSpeedCPUAdagrad(Adagrad):
    """Adagrad for CPU parameters with DeepSpeed's arguments (``lr`` 1e-2, ``eps`` 1e-10).

    ``amsgrad`` is accepted and has no effect, as in DeepSpeed.  Sparse gradients
    are supported (torch's single-tensor path).
    """

    optimizer_id = 0
    _cpu_only = True
    _label = "DeepSpeedCPUAdagrad"

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fp32_optimizer_states=fp32_optimizer_states)
        self.opt_id = DeepSpeedCPUAdagrad.optimizer_id
        DeepSpeedCPUAdagrad.optimizer_id += 1
