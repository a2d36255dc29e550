"""ZeRO-3 leaf modules (``deepspeed.utils.set_z3_leaf_modules``).

A leaf module is gathered as one unit: entering it gathers the parameters of all its
submodules, and no hooks are placed inside it. Mixture-of-experts blocks, whose experts run
in a data-dependent order, need this. The flag is ``module._z3_leaf``, as in DeepSpeed; the
ZeRO-3 strategy reads it when the engine is built, so set it before ``initialize``.
"""

from __future__ import annotations

import torch

from shardwise.param_attrs import is_z3_leaf, set_z3_leaf


def z3_leaf_module(model: torch.nn.Module) -> bool:
    return is_z3_leaf(model)


def z3_leaf_parameter(model: torch.nn.Parameter) -> bool:
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    set_z3_leaf(model, flag)


def _matches(module: torch.nn.Module, wanted) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_flags(model, leaf_module_classes, flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    bad = [c for c in leaf_module_classes if not isinstance(c, (type, str))]
    if bad:
        raise ValueError(f"leaf_module_classes must be module classes or class names, got {bad!r}")
    found = []
    for module in model.modules():
        if any(_matches(module, c) for c in leaf_module_classes):
            set_z3_leaf(module, flag)
            found.append(module)
    if not found and raise_if_not_found:
        raise ValueError(f"no modules of type {list(leaf_module_classes)} found in the model "
                         f"({type(model).__name__})")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True):
    """Flag every module of one of ``leaf_module_classes`` (classes or class names) as a leaf;
    returns the flagged modules."""
    return _set_flags(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True):
    return _set_flags(model, leaf_module_classes, False, raise_if_not_found)


def apply_leaf_module_config(model: torch.nn.Module, block) -> list[str]:
    """Flag the modules ``zero_optimization.leaf_module`` names (its ``classes``, ``names`` and
    ``name_suffixes``); returns their names. Class names that match nothing are fine (the defaults name
    Hugging Face MoE blocks); a module name that matches nothing is a mistake."""
    found = []
    names = dict(model.named_modules())
    for name in block.names:
        if name not in names:
            raise ValueError(f"zero_optimization.leaf_module.names: no module named {name!r} in the model "
                             f"({type(model).__name__})")
    for name, module in names.items():
        if (any(_matches(module, c) for c in block.classes) or name in block.names
                or any(name.endswith(s) for s in block.name_suffixes if name)):
            set_z3_leaf(module, True)
            found.append(name)
    return found
