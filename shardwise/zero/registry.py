"""Which ZeRO strategy owns a model parameter, for the lookups that start from a parameter:
``zero.GatheredParameters`` writing a modified weight back into the fp32 master copy, and
``shardwise.utils.safe_get_full_*``. A strategy registers its parameters when it is built; the entries
refer to the strategy (and the loss scaler whose scale its gradients carry), never to the engine, and
vanish with the parameter or the strategy.
"""

from __future__ import annotations

import weakref

import torch

_OWNERS: dict[int, tuple[weakref.ref, weakref.ref, str]] = {}  # id(param) -> (param, strategy, name)
_SCALERS: dict[int, weakref.ref] = {}  # id(strategy) -> the loss scaler of its gradients


def register(strategy, named_params) -> None:
    """``strategy`` owns ``named_params`` ((name, parameter) pairs) from now on."""
    key = id(strategy)
    owner = weakref.ref(strategy, lambda _: _SCALERS.pop(key, None))
    for name, p in named_params:
        _OWNERS[id(p)] = (weakref.ref(p, lambda _, i=id(p): _OWNERS.pop(i, None)), owner, name)


def set_loss_scaler(strategy, scaler) -> None:
    """The gradients ``strategy`` holds are scaled by ``scaler.loss_scale`` (fp16; ``None``: not scaled)."""
    if scaler is None:
        _SCALERS.pop(id(strategy), None)
    else:
        _SCALERS[id(strategy)] = weakref.ref(scaler)


def owner_of(param: torch.nn.Parameter):
    """``(strategy, name)`` of the strategy that owns ``param``, or ``None``."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    strategy = entry[1]()
    return (strategy, entry[2]) if strategy is not None else None


def loss_scale_of(strategy) -> float:
    """The loss scale the gradients of ``strategy`` carry now (1.0 without loss scaling)."""
    ref = _SCALERS.get(id(strategy))
    scaler = ref() if ref is not None else None
    return scaler.loss_scale if scaler is not None else 1.0
