"""``deepspeed.utils.z3_leaf_module``: ZeRO-3 leaf modules (``shardwise.utils.z3_leaf_module``), plus DeepSpeed's
by-name and by-suffix setters. A leaf's flag is ``module._z3_leaf``, read by ZeRO-3 when the engine is built."""
from shardwise.param_attrs import set_z3_leaf
from shardwise.utils.z3_leaf_module import *  # noqa: F401,F403
from shardwise.utils.z3_leaf_module import (get_z3_leaf_modules, set_z3_leaf_module,  # noqa: F401
                                            set_z3_leaf_modules, unset_z3_leaf_modules, z3_leaf_module,
                                            z3_leaf_parameter)


def set_z3_leaf_modules_by_name(model, module_names, flag=True, raise_if_not_found=True):
    """Set (``flag``) the leaf flag of the modules named in ``module_names`` (names as ``model.named_modules()``
    gives them). Returns ``(modules, missing_names)``; ``ValueError`` naming the missing ones unless
    ``raise_if_not_found`` is False."""
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        module = by_name.get(name)
        if module is None:
            missing.append(name)
            continue
        set_z3_leaf(module, flag)
        found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules named {missing} found in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_suffix(model, module_name_suffixes, flag=True, raise_if_not_found=True):
    """Set (``flag``) the leaf flag of every module whose name ends with one of ``module_name_suffixes``.
    Returns ``(modules, missing_suffixes)``, each module once; ``ValueError`` for suffixes matching nothing
    unless ``raise_if_not_found`` is False."""
    named = list(model.named_modules())
    found, seen, missing = [], set(), []
    for suffix in module_name_suffixes:
        hits = [m for name, m in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for module in hits:
            set_z3_leaf(module, flag)
            if id(module) not in seen:
                seen.add(id(module))
                found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"No modules matching suffixes {missing} found in model {type(model).__name__}")
    return found, missing
