"""``deepspeed.utils.module_utils``: reach a submodule (or any attribute) by its dotted name."""
from __future__ import annotations

import functools


def recursive_getattr(model, module_name: str):
    """``model.a.b.c`` for ``module_name="a.b.c"``."""
    return functools.reduce(getattr, module_name.split("."), model)


def recursive_setattr(model, module_name: str, module) -> None:
    """Set ``model.a.b.c = module`` for ``module_name="a.b.c"``."""
    parent, _, leaf = module_name.rpartition(".")
    setattr(recursive_getattr(model, parent) if parent else model, leaf, module)
