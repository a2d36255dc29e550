"""``deepspeed.runtime.zero.linear``: DeepSpeed's linear layer written for ZeRO-3, as an autograd function.

``LinearFunctionForZeroStage3`` computes ``input @ weight.T + bias`` and keeps for backward only the tensors
it was given (the input, the weight, the bias), never the lower-precision copies autocast makes of them:
under autocast, ``nn.Linear`` saves the casted weight, this function casts again in backward instead. Its
forward runs under the caller's autocast state and its backward under the same state (torch's
``custom_fwd``/``custom_bwd``), so an ``autocast(enabled=False)`` region stays fp32 both ways.

Because it saves the weight parameter itself rather than a transposed view of its data, a ZeRO-3 weight
released after forward holds no memory until backward: backward reads the parameter as it is then (gathered
again by the ZeRO-3 coordinator before the module's backward, or gathered here for that one product when it
is still released, as for a weight used functionally outside its module). ``deepspeed.zero.Init`` installs
``zero3_linear_wrap`` as ``torch.nn.functional.linear`` (``mem_efficient_linear``, see
``partition_parameters``). ``LinearModuleForZeroStage3`` is the module around it, with ``nn.Linear``'s
shapes and initialisation.
"""
from __future__ import annotations

import functools

import torch

from shardwise.accelerator import get_accelerator


def noop_decorator(func):
    """A decorator that changes nothing (DeepSpeed's stand-in where torch lacks the AMP decorators)."""
    return func


# torch.amp's decorators for this process's device, as DeepSpeed builds them (shardwise needs torch >= 2.4)
autocast_custom_fwd = functools.partial(torch.amp.custom_fwd, device_type=get_accelerator().device_name())
autocast_custom_bwd = functools.partial(torch.amp.custom_bwd, device_type=get_accelerator().device_name())


class LinearFunctionForZeroStage3(torch.autograd.Function):
    """``y = input @ weight.T + bias`` (``bias`` may be None), any number of leading input dimensions."""

    @staticmethod
    @autocast_custom_fwd
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        return _torch_linear(input, weight, bias)  # torch's kernel, whatever F.linear is bound to now

    @staticmethod
    @autocast_custom_bwd
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            weight_now = _whole(weight)
        rows = grad_output.reshape(-1, grad_output.shape[-1])  # (tokens, out_features)
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight_now.to(grad_output.dtype))
        if ctx.needs_input_grad[1]:
            grad_weight = rows.t().matmul(input.reshape(-1, input.shape[-1]).to(rows.dtype))
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_input, grad_weight, grad_bias


_torch_linear = torch._C._nn.linear  # the kernel behind torch.nn.functional.linear, bound once


def _whole(weight: torch.Tensor) -> torch.Tensor:
    """The weight's values for backward: the parameter itself, or -- a ZeRO-3 parameter still released at
    backward (used outside the module whose hooks gather it) -- a gathered copy for this product only."""
    from shardwise.zero.partitioned_param import ZeroParamStatus, gather_full, is_partitioned

    if is_partitioned(weight) and weight.ds_status is ZeroParamStatus.NOT_AVAILABLE:
        return gather_full(weight)
    return weight


def zero3_linear_wrap(input, weight, bias=None):
    """``torch.nn.functional.linear``'s signature, computed by ``LinearFunctionForZeroStage3`` (a weight that
    is not a matrix goes to torch's kernel: the function is written for ``(out, in)`` weights)."""
    if weight.dim() != 2:
        return _torch_linear(input, weight, bias)
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(torch.nn.Module):
    """``nn.Linear(in_features, out_features, bias)`` (same parameter shapes, same initialisation) whose
    forward is ``LinearFunctionForZeroStage3``."""

    __constants__ = ["in_features", "out_features"]

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features))
        self.register_parameter("bias", torch.nn.Parameter(torch.empty(out_features)) if bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.Linear.reset_parameters(self)  # reads only weight and bias

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return LinearFunctionForZeroStage3.apply(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


__all__ = ["LinearFunctionForZeroStage3", "LinearModuleForZeroStage3", "autocast_custom_bwd", "autocast_custom_fwd",
           "noop_decorator", "zero3_linear_wrap"]
