"""``get_model_profile``: profile one forward pass of a model outside the engine."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .flops import FlopsProfiler
from .report import human


def _example_input(model: torch.nn.Module, input_shape: Sequence[int]) -> torch.Tensor:
    p = next(model.parameters(), None)
    dtype = p.dtype if p is not None and p.is_floating_point() else torch.float32
    device = p.device if p is not None else torch.device("cpu")
    return torch.ones(tuple(input_shape), dtype=dtype, device=device)


def get_model_profile(model: torch.nn.Module, input_shape: Sequence[int] | None = None, args: Sequence[Any] = (),
                      kwargs: dict | None = None, print_profile: bool = True, detailed: bool = True,
                      module_depth: int = -1, top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules=None, mode: str = "forward"):
    """Run ``warm_up`` untimed forwards, then one profiled forward; return ``(flops, macs, params)``.

    The input is ``args``/``kwargs``, or a tensor of ones of ``input_shape`` (in the parameters'
    dtype and device) when the model takes one floating-point tensor. Runs under ``no_grad``.
    With ``as_string`` the three numbers come back human-readable ("1.23 GFLOPs").
    """
    if mode != "forward":
        raise ValueError(f"get_model_profile: mode={mode!r} is not supported; use mode='forward'")
    if input_shape is not None and (args or kwargs):
        raise ValueError("get_model_profile: give either input_shape or args/kwargs, not both")
    if input_shape is None and not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape=(batch, ...) or args=[...]/kwargs={...}")
    if input_shape is not None:
        if not all(isinstance(d, int) and d > 0 for d in input_shape):
            raise ValueError(f"get_model_profile: input_shape must be positive ints, got {tuple(input_shape)!r}")
        args = (_example_input(model, input_shape),)
    kwargs = dict(kwargs or {})
    prof = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            model(*args, **kwargs)
        prof.start_profile(ignore_list=ignore_modules)
        try:
            model(*args, **kwargs)
        finally:
            prof.stop_profile()
    if print_profile:
        prof.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                 detailed=detailed, output_file=output_file)
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    if as_string:
        return human(flops, "FLOPs"), human(macs, "MACs"), human(params, "")
    return flops, macs, params
