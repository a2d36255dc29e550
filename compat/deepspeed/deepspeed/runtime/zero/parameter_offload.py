"""``deepspeed.runtime.zero.parameter_offload``: ``ZeROOrderedDict`` and ``ensure_zero_ordered_dict``.

Under ZeRO-3 DeepSpeed replaces every module's ``_parameters`` container with a ``ZeROOrderedDict``: the same
parameters, plus the owning module and an ``_in_forward`` flag its forward hooks set. Reading a parameter
from it while that module's forward runs gathers the parameter if it is released (a parameter the module
reads that its own gather did not fetch). ``deepspeed.initialize`` with ZeRO stage 3 does the same here: the
engine converts every module's container when it is built and, before each forward, any module attached
since (``ensure_zero_ordered_dict``), and the gather goes through the parameter's shardwise ZeRO-3 unit
(``shardwise.zero.coordinator``), which releases it with the rest of that unit. shardwise's own engine needs
none of this: it gathers around each module's forward.

A parameter of DeepSpeed's own kind (one that carries ``all_gather`` / ``partition`` methods) is gathered with
its ``all_gather()``. While a DeepCompile eager-fallback forward is open (``deepspeed.compile.z3_eager_fallback``)
that fallback takes the gathered parameter over (it partitions it after the forward, or after the backward
of a forward graph that used it), is told about reads of parameters it already holds, and a read made by
Dynamo's guard code (which only checks identity and metadata) gathers nothing and is recorded instead;
without a fallback the parameter is registered as an external parameter of the innermost module in forward."""
from __future__ import annotations

from collections import OrderedDict

import torch

from shardwise.zero.partitioned_param import ZeroParamStatus, unit_of

from deepspeed.compile import z3_eager_fallback
from deepspeed.runtime.zero.partition_parameters import print_rank_0, register_external_parameter

__all__ = ["ZeROOrderedDict", "ensure_zero_ordered_dict", "print_rank_0"]

FWD_MODULE_STACK: list = []  # DeepSpeed's stack of modules in forward, innermost last
_HOOKED = "_ds_zero_ordered_dict_hooks"


class ZeROOrderedDict(OrderedDict):
    """A module's parameter container under ZeRO-3 (see the module)."""

    def __init__(self, parent_module, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._parent_module = parent_module
        self._in_forward = False

    def __reduce__(self):
        # rebuilt with its module (pickling a model, deep-copying it)
        rebuild, _, *rest = super().__reduce__()
        return (rebuild, (self._parent_module, )) + tuple(rest)

    def __getitem__(self, key):
        param = super().__getitem__(key)
        if param is None or not hasattr(param, "ds_status") or torch.compiler.is_compiling():
            return param
        owner = getattr(self._parent_module, "_parameters", self)
        if not getattr(owner, "_in_forward", False):
            return param
        fallback = z3_eager_fallback.get_active_z3_eager_fallback()
        if fallback is not None and param.ds_status == ZeroParamStatus.AVAILABLE \
                and not z3_eager_fallback.is_dynamo_guard_evaluation():
            fallback.record_param_access(param)
        if param.ds_status != ZeroParamStatus.NOT_AVAILABLE:
            return param
        unit = unit_of(param)
        if unit is not None:  # a shardwise ZeRO-3 parameter: its unit gathers it and releases it with the unit
            unit.start_gather()
            unit.finish_gather()
        elif callable(getattr(param, "all_gather", None)):  # DeepSpeed's kind of parameter gathers itself
            if fallback is not None and z3_eager_fallback.is_dynamo_guard_evaluation():
                # a Dynamo guard only checks identity and metadata: gathering would keep the whole
                # parameter alive before the compiled forward starts
                fallback.record_guard_suppressed_param(param)
                return param
            param.all_gather()
            if fallback is not None:
                fallback.record_gathered_param(param)
            elif FWD_MODULE_STACK:
                register_external_parameter(FWD_MODULE_STACK[-1], param)
            print_rank_0(f"Registering external parameter from getter {key} ds_id = {param.ds_id}", force=False)
        return param


def ensure_zero_ordered_dict(module) -> None:
    """Make ``module._parameters`` a ``ZeROOrderedDict`` holding the same parameters, keeping the container
    it replaces in ``module._original_parameters`` (only the first time). Nothing happens when it already is
    one, or when ``_parameters`` is missing or not a dict."""
    params = getattr(module, "_parameters", None)
    if isinstance(params, ZeROOrderedDict) or not isinstance(params, dict):
        return
    if not hasattr(module, "_original_parameters"):
        module._original_parameters = params
    module._parameters = ZeROOrderedDict(module, params.items())


def _inject_parameters(module, cls) -> None:
    """Give every module under ``module`` a new ``cls`` container with its parameters, keeping the old one in
    ``_original_parameters``."""
    for m in module.modules():
        m._original_parameters = m._parameters
        new = cls(parent_module=m) if cls is ZeROOrderedDict else cls()
        new.update(m._parameters.items())
        m._parameters = new


def _enter(module, *_):
    FWD_MODULE_STACK.append(module)
    if isinstance(module._parameters, ZeROOrderedDict):
        module._parameters._in_forward = True


def _leave(module, *_):
    if FWD_MODULE_STACK and FWD_MODULE_STACK[-1] is module:
        FWD_MODULE_STACK.pop()
    if isinstance(module._parameters, ZeROOrderedDict):
        module._parameters._in_forward = False


def _zero3_module_prologue(root: torch.nn.Module) -> None:
    """Every module under ``root``: its container a ``ZeROOrderedDict`` and its forward flagged (the hooks
    are added once per module; modules attached after ``initialize`` get them at the next forward)."""
    for m in root.modules():
        ensure_zero_ordered_dict(m)
        if not getattr(m, _HOOKED, False):
            m.register_forward_pre_hook(_enter)
            m.register_forward_hook(_leave, always_call=True)
            setattr(m, _HOOKED, True)
