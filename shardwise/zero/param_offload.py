"""ZeRO-3's module hooks as DeepSpeed shows them: ``engine.optimizer.parameter_offload``.

DeepSpeed's stage-3 optimizer carries a ``DeepSpeedZeRoOffload`` that owns the forward/backward hooks
which gather and release parameters. Code that generates text with weights gathered once (TRL's
``unwrap_model_for_generation``, DeepSpeed's ``deepspeed.runtime.zero.unwrap_model_for_generation``)
removes those hooks inside ``GatheredParameters(model.parameters())``, runs ``generate``, then puts them
back with ``_register_deepspeed_module(module)`` and drops the recorded prefetch order
(``param_coordinator._invalidate_trace()``). :class:`ParameterOffload` answers those calls on shardwise's
:class:`~shardwise.zero.coordinator.ParamCoordinator`. Here the hooks gather in forward and arm the
gathers of backward from the forward hook, so all handles are forward hooks and ``backward_hooks`` is empty.

``attach`` also gives the model the per-object names that code reads: ``module.ds_external_parameters()``
(the parameters registered with ``register_external_parameter``) on every module, and
``param.ds_active_sub_modules`` on every partitioned parameter. The latter stays empty: shardwise counts a
unit's users per unit (``Unit.users``), not per parameter.
"""

from __future__ import annotations

import contextlib
import types

import torch

from shardwise.param_attrs import external_params
from shardwise.zero.coordinator import ParamCoordinator


class _Trace:
    """``param_coordinator``: the recorded unit order the next pass prefetches by."""

    def __init__(self, coordinator: ParamCoordinator) -> None:
        self._coordinator = coordinator

    def is_invalid_trace(self) -> bool:
        return not (self._coordinator.fwd_trace or self._coordinator.bwd_trace)

    def _invalidate_trace(self) -> None:
        if self.is_invalid_trace():
            raise RuntimeError("attempted to invalidate already invalid trace")  # as DeepSpeed
        self._coordinator.forget_trace()


class ParameterOffload:
    """DeepSpeed's ``DeepSpeedZeRoOffload`` calls on a stage-3 strategy's coordinator."""

    def __init__(self, module: torch.nn.Module, coordinator: ParamCoordinator) -> None:
        self.module = module
        self._coordinator = coordinator
        self.param_coordinator = _Trace(coordinator)

    @property
    def forward_hooks(self) -> list:
        """The hook handles now registered (``handle.remove()`` takes one off its module)."""
        return self._coordinator.hook_handles()

    @forward_hooks.setter
    def forward_hooks(self, handles: list) -> None:
        self._assign(handles, "forward_hooks")

    @property
    def backward_hooks(self) -> list:
        return []

    @backward_hooks.setter
    def backward_hooks(self, handles: list) -> None:
        self._assign(handles, "backward_hooks")

    def _assign(self, handles: list, name: str) -> None:
        if list(handles):
            raise ValueError(f"parameter_offload.{name}: only an empty list can be assigned (after removing the "
                             f"hooks); register them again with _register_deepspeed_module(module)")
        self._coordinator.forget_removed_hooks()

    def _register_deepspeed_module(self, module: torch.nn.Module, count=None) -> None:
        """Put the gathering hooks back on ``module``'s subtree (those already there stay, once)."""
        self._coordinator.restore_hooks(module)

    def get_param_coordinator(self) -> _Trace:
        return self.param_coordinator


def attach(module: torch.nn.Module, coordinator: ParamCoordinator, optimizer) -> ParameterOffload:
    """Give ``optimizer`` its ``parameter_offload`` and the model DeepSpeed's ZeRO-3 per-object names."""
    for m in module.modules():
        if "ds_external_parameters" not in m.__dict__:
            m.ds_external_parameters = types.MethodType(_external_named, m)
    for u in coordinator.units:
        for p in u.params:
            if not hasattr(p, "ds_active_sub_modules"):
                p.ds_active_sub_modules = set()
    view = ParameterOffload(module, coordinator)
    if optimizer is not None:
        optimizer.parameter_offload = view
    return view


def _external_named(module: torch.nn.Module):
    return [(id(p), p) for p in external_params(module)]  # (DeepSpeed keys them by id too)


@contextlib.contextmanager
def gathered_for_generation(engine):
    """Every ZeRO-3 parameter gathered once and the per-module hooks off for the block (DeepSpeed's
    ``deepspeed.runtime.zero.unwrap_model_for_generation``); yields the engine. Collective."""
    from shardwise.zero.init import GatheredParameters

    view = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if view is None:
        raise ValueError("unwrap_model_for_generation needs a ZeRO stage 3 engine with an optimizer "
                         f"(engine.optimizer.parameter_offload); got {type(engine).__name__} without one")
    with GatheredParameters(list(engine.parameters())):
        for hook in view.forward_hooks:
            hook.remove()
        view.forward_hooks = []
        try:
            yield engine
        finally:
            view._register_deepspeed_module(view.module)
