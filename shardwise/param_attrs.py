"""Attributes shardwise puts on parameters and modules in one package and reads in another,
declared once here with their accessors. Everything else goes through these functions.

* ``ds_grad_is_ready`` (parameter; DeepSpeed's name, so code written for DeepSpeed keeps working):
  False while a tiled computation (``runtime/sequence_parallel/tiled.py``) still adds to the
  gradient; ZeRO's bucket hooks (``zero/buckets.py``) wait for True. The hooks run once per gradient
  and read the attribute by its name here (``GRAD_IS_READY``) instead of calling ``grad_is_ready``.
* ``_ds_unit`` (parameter): the ZeRO-3 unit holding the parameter's shard (``zero/coordinator.py``).
* ``_autotp_grad_allreduce`` (parameter): automatic tensor parallelism already sums this replicated
  parameter's gradient over the tensor group (``tensor_parallel/autotp.py``).
* ``_sw_external_params`` (module): parameters owned elsewhere that the module's forward uses
  (``zero.register_external_parameter``); ZeRO-3 gathers them around it.
* ``_z3_leaf`` (module; DeepSpeed's name): ``set_z3_leaf_modules`` made the whole subtree one ZeRO-3
  unit (``utils/z3_leaf_module.py``, read by ``zero/stage3.py``).
"""

from __future__ import annotations

import torch

GRAD_IS_READY = "ds_grad_is_ready"  # (absent: True)
_ZERO_UNIT = "_ds_unit"
_AUTOTP_GRAD_ALLREDUCE = "_autotp_grad_allreduce"
_EXTERNAL_PARAMS = "_sw_external_params"
_Z3_LEAF = "_z3_leaf"


def grad_is_ready(param: torch.Tensor) -> bool:
    return bool(getattr(param, GRAD_IS_READY, True))


def set_grad_is_ready(param: torch.Tensor, ready: bool) -> None:
    setattr(param, GRAD_IS_READY, bool(ready))


def zero_unit(param: torch.Tensor):
    return getattr(param, _ZERO_UNIT, None)


def set_zero_unit(param: torch.Tensor, unit) -> None:
    setattr(param, _ZERO_UNIT, unit)


def autotp_grad_allreduce(param: torch.Tensor) -> bool:
    return bool(getattr(param, _AUTOTP_GRAD_ALLREDUCE, False))


def mark_autotp_grad_allreduce(param: torch.Tensor) -> None:
    setattr(param, _AUTOTP_GRAD_ALLREDUCE, True)


def external_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return list(module.__dict__.get(_EXTERNAL_PARAMS, []))


def add_external_param(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    external = module.__dict__.setdefault(_EXTERNAL_PARAMS, [])
    if not any(p is param for p in external):
        external.append(param)


def is_z3_leaf(module: torch.nn.Module) -> bool:
    return bool(getattr(module, _Z3_LEAF, False))


def set_z3_leaf(module: torch.nn.Module, flag: bool) -> None:
    setattr(module, _Z3_LEAF, flag)
