"""``deepspeed.ops.adam.cpu_adam.DeepSpeedCPUAdam`` on torch's fused CPU Adam kernel."""

from __future__ import annotations

from shardwise.optim.adam import Adam


class DeepSpeedCPUAdam(Adam):
    """Adam/AdamW for parameters on the CPU (ZeRO-Offload), with DeepSpeed's arguments.

    ``adamw_mode`` (default true) selects decoupled weight decay; false adds
    ``weight_decay * p`` to the gradient.  ``fp32_optimizer_states`` (default true)
    keeps the moments in fp32 whatever the parameter dtype.  ``amsgrad=True`` is
    refused, as in DeepSpeed.
    """

    optimizer_id = 0
    _cpu_only = True
    _label = "DeepSpeedCPUAdam"

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adamw_mode,
                         fp32_optimizer_states=fp32_optimizer_states, set_grad_none=True)
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
