"""``deepspeed.ops.adam.fused_adam.FusedAdam`` on torch's fused Adam kernel (CPU and CUDA)."""

from __future__ import annotations

from shardwise.optim.adam import Adam


class FusedAdam(Adam):
    """Adam/AdamW with DeepSpeed's ``FusedAdam`` arguments; states in the parameter dtype.

    ``adam_w_mode`` (default true) selects decoupled weight decay; ``set_grad_none``
    (default true) makes ``zero_grad()`` set gradients to None.  ``amsgrad=True`` is
    refused, as in DeepSpeed.
    """

    _label = "FusedAdam"

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0., amsgrad=False, set_grad_none=True):
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=False, adamw_mode=adam_w_mode,
                         fp32_optimizer_states=False, set_grad_none=set_grad_none)
