"""Build the optimizer and LR schedule named in the ``optimizer`` / ``scheduler`` config blocks.

Type names are matched case-insensitively, as DeepSpeed does for its own
optimizers. Unset parameters take DeepSpeed's defaults, which for Adam differ
from torch's (``weight_decay`` 0). Mistakes raise ``ValueError`` naming the
config key (``optimizer.type``, ``optimizer.params.<name>``, ...).
"""

from __future__ import annotations

import difflib
import inspect
import logging
import numbers
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .adam import Adam as ShardwiseAdam
from .lamb import Lamb
from .lion import Lion
from .lr_schedules import (
    LRRangeTest,
    ScheduleParamError,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)
from .one_cycle import OneCycle
from .onebit import OneBitAdam, OneBitLamb, ZeroOneAdam

logger = logging.getLogger(__name__)

# DeepSpeed optimizer types that shardwise does not provide (yet).
_NOT_IMPLEMENTED = {
    name.lower(): name for name in ("MuAdam", "MuAdamW", "MuSGD")
}
_ADAM_EXTRAS = ("torch_adam", "adam_w_mode", "bias_correction", "set_grad_none")
_ADAM_DEFAULTS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_OWN_OPTIMIZERS: dict[str, tuple[str, type[torch.optim.Optimizer]]] = {
    "lamb": ("Lamb", Lamb),
    "lion": ("Lion", Lion),
    # 1-bit compressed communication (shardwise/optim/onebit, docs/onebit.md)
    "onebitadam": ("OneBitAdam", OneBitAdam),
    "zerooneadam": ("ZeroOneAdam", ZeroOneAdam),
    "onebitlamb": ("OneBitLamb", OneBitLamb),
}
_OWN_SCHEDULERS: dict[str, type] = {
    cls.__name__.lower(): cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)
}


def _did_you_mean(word: str, candidates: Iterable[str]) -> str:
    by_lower = {c.lower(): c for c in candidates}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" Did you mean {by_lower[close[0]]!r}?" if close else ""


def _torch_optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    found = {}
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer:
            found[name.lower()] = obj
    return found


def _torch_scheduler_classes() -> dict[str, type]:
    base = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    found = {}
    for name in dir(torch.optim.lr_scheduler):
        obj = getattr(torch.optim.lr_scheduler, name)
        if isinstance(obj, type) and issubclass(obj, base) and obj not in base and not name.startswith("_"):
            found[name.lower()] = obj
    return found


def _accepted_params(fn: Callable, *, skip: tuple[str, ...]) -> dict[str, inspect.Parameter]:
    sig = inspect.signature(fn)
    return {
        name: p
        for name, p in sig.parameters.items()
        if name not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _check_names(prefix: str, kind: str, given: dict[str, Any], valid: Iterable[str]) -> None:
    valid = sorted(valid)
    for name in given:
        if name not in valid:
            raise ValueError(
                f"{prefix}.{name}: unknown parameter for {kind}. Valid parameters: {', '.join(valid)}."
                + _did_you_mean(name, valid)
            )


def _culprit(prefix: str, given: dict[str, Any], err: Exception) -> str:
    """``prefix.<name>`` when exactly one given parameter is mentioned in a library's error, else ``prefix``."""
    words = set(re.findall(r"[A-Za-z_]+", str(err)))
    named = [name for name in given if name in words]
    return f"{prefix}.{named[0]}" if len(named) == 1 else prefix


def _drop_auto(prefix: str, params: dict[str, Any]) -> dict[str, Any]:
    """'auto' (from Hugging Face templates) means "use the default"."""
    out = {}
    for key, value in params.items():
        if isinstance(value, str) and value == "auto":
            logger.info("%s.%s is 'auto': using the default", prefix, key)
            continue
        out[key] = value
    return out


# ----------------------------------------------------------------------------- optimizers


def _check_optimizer_values(params: dict[str, Any], accepted: dict[str, inspect.Parameter]) -> dict[str, Any]:
    """Type/range checks with config paths in the message; returns params with betas as a tuple."""
    out = dict(params)
    for name, value in params.items():
        where = f"optimizer.params.{name}"
        default = accepted[name].default if name in accepted else None
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: must be true or false, got {value!r}")
        elif name in ("lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay") and isinstance(
            default, numbers.Real
        ):
            number = float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if isinstance(number, bool) or not isinstance(number, numbers.Real):
                raise ValueError(f"{where}: must be a number, got {value!r}")
            if number < 0:
                raise ValueError(f"{where}: must be >= 0, got {value!r}")
        elif name == "betas":
            ok = isinstance(value, (list, tuple)) and len(value) == 2
            ok = ok and all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= b < 1 for b in value)
            if not ok:
                raise ValueError(f"{where}: must be a list of two numbers in [0, 1), got {value!r}")
            out[name] = tuple(float(b) for b in value)
    return out


def _param_tensors(groups: list[Any]) -> list[torch.Tensor]:
    tensors = []
    for item in groups:
        if isinstance(item, dict):
            ps = item.get("params", [])
            ps = [ps] if isinstance(ps, torch.Tensor) else list(ps)
            tensors.extend(p[1] if isinstance(p, tuple) else p for p in ps)
        elif isinstance(item, tuple):  # (name, tensor) pairs
            tensors.append(item[1])
        else:
            tensors.append(item)
    return [t for t in tensors if isinstance(t, torch.Tensor)]


_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _pick_implementation(cls: type, params: dict[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Take torch's fused kernel where the class has one for these tensors, else the foreach path.

    torch 2.13 has fused Adam, AdamW, SGD and Adagrad kernels on CPU and CUDA: one
    pass over memory per tensor, against one per elementary op for ``foreach``
    (about 5x faster for AdamW on CPU).  Our own classes (Lamb, Lion) choose
    their path per tensor themselves.  An explicit ``foreach`` or ``fused`` wins.
    """
    if "foreach" in params or "fused" in params or not cls.__module__.startswith("torch."):
        return params
    accepted = inspect.signature(cls.__init__).parameters
    devices = {t.device.type for t in tensors}
    fusable = (
        tensors
        and len(devices) == 1
        and devices <= set(_FUSED_DEVICES)
        and all(t.dtype in _FUSED_DTYPES for t in tensors)
        and not params.get("differentiable", False)
    )
    if "fused" in accepted and fusable:
        return {**params, "fused": True}
    if "foreach" in accepted:
        return {**params, "foreach": True}
    return params


def optimizer_class(type_name: str):
    """The class shardwise builds for ``optimizer.type`` when it is one of its own (Lamb, Lion, the 1-bit
    optimizers), else None."""
    own = _OWN_OPTIMIZERS.get(str(type_name).lower())
    return own[1] if own is not None else None


def build_optimizer(type_name: str, params: dict[str, Any] | None, model_parameters: Any) -> torch.optim.Optimizer:
    """Create the optimizer named by ``optimizer.type`` with ``optimizer.params``.

    ``model_parameters`` is an iterable of tensors or of param-group dicts (their
    own ``lr``/``weight_decay`` etc. are kept), as passed to ``initialize``.
    """
    if not isinstance(type_name, str) or not type_name:
        raise ValueError(f"optimizer.type: must be a non-empty string, got {type_name!r}")
    params = _drop_auto("optimizer.params", dict(params or {}))
    if "max_grad_norm" in params:
        raise ValueError(
            "optimizer.params.max_grad_norm: not supported as an optimizer parameter; "
            "set the top-level 'gradient_clipping' key instead"
        )
    if model_parameters is None or isinstance(model_parameters, torch.Tensor):
        raise ValueError(
            "model_parameters: expected an iterable of tensors or of param-group dicts "
            f"(e.g. model.parameters()), got {type(model_parameters).__name__}"
        )
    groups = list(model_parameters)
    if not groups:
        raise ValueError("model_parameters: is empty; there are no parameters to optimize")

    key = type_name.lower()
    torch_classes = _torch_optimizer_classes()
    if key in _NOT_IMPLEMENTED:
        raise ValueError(f"not implemented yet: optimizer.type={_NOT_IMPLEMENTED[key]}")

    if key == "muon":
        return _build_muon(params, groups)
    if key in ("adam", "adamw"):
        canonical = "Adam" if key == "adam" else "AdamW"
        accepted = _accepted_params(torch.optim.AdamW.__init__, skip=("self", "params"))
        _check_names("optimizer.params", f"optimizer type {canonical}", params, [*accepted, *_ADAM_EXTRAS])
        for flag in _ADAM_EXTRAS:
            if flag in params and not isinstance(params[flag], bool):
                raise ValueError(f"optimizer.params.{flag}: must be true or false, got {params[flag]!r}")
        params.pop("torch_adam", None)  # always torch's implementation here
        params.pop("set_grad_none", None)  # torch's zero_grad sets grads to None by default
        bias_correction = params.pop("bias_correction", True)
        adam_w_mode = params.pop("adam_w_mode", True)
        if canonical == "AdamW" and not adam_w_mode:
            raise ValueError(
                "optimizer.params.adam_w_mode: false contradicts optimizer.type=AdamW; "
                "use type Adam with adam_w_mode false for L2-style weight decay"
            )
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        kwargs = {**_ADAM_DEFAULTS, **_check_optimizer_values(params, accepted)}
        if not bias_correction:  # torch's Adam always bias-corrects: ours runs the same ops without it
            for name in ("foreach", "fused", "capturable", "differentiable", "maximize", "amsgrad"):
                if kwargs.get(name):
                    raise ValueError(f"optimizer.params.{name}: not supported together with bias_correction false")
                kwargs.pop(name, None)
            cls = ShardwiseAdam
            kwargs.update(bias_correction=False, adamw_mode=adam_w_mode)
    elif key in _OWN_OPTIMIZERS:
        canonical, cls = _OWN_OPTIMIZERS[key]
        accepted = _accepted_params(cls.__init__, skip=("self", "params"))
        _check_names("optimizer.params", f"optimizer type {canonical}", params, accepted)
        kwargs = _check_optimizer_values(params, accepted)
    elif key in torch_classes:
        cls = torch_classes[key]
        canonical = cls.__name__
        accepted = _accepted_params(cls.__init__, skip=("self", "params"))
        _check_names("optimizer.params", f"optimizer type {canonical} (torch.optim.{canonical})", params, accepted)
        kwargs = _check_optimizer_values(params, accepted)
    else:
        torch_names = sorted(c.__name__ for k, c in torch_classes.items() if k not in _NOT_IMPLEMENTED)
        valid = list(dict.fromkeys(["Adam", "AdamW", "Lamb", "Lion", "OneBitAdam", "ZeroOneAdam", "OneBitLamb",
                                    *torch_names]))
        raise ValueError(
            f"optimizer.type: unknown optimizer {type_name!r}. Valid types: {', '.join(valid)}."
            + _did_you_mean(type_name, [*valid, *_NOT_IMPLEMENTED.values()])
        )

    kwargs = _pick_implementation(cls, kwargs, _param_tensors(groups))
    try:
        return cls(groups, **kwargs)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{_culprit('optimizer.params', params, err)}: {canonical} rejected it: {err}") from err


_MUON_PARAMS = ("lr", "momentum", "weight_decay", "ns_method", "muon_lr", "adam_lr", "betas", "eps", "adam_w_mode",
                "per_head_muon", "ns_dtype")


def _build_muon(params: dict[str, Any], groups: list) -> torch.optim.Optimizer:
    """``"type": "Muon"`` (shardwise/optim/muon.py): DeepSpeed's parameters, plus ``ns_dtype``."""
    from .muon import _DTYPES, NS_METHODS, Muon, muon_param_groups

    _check_names("optimizer.params", "optimizer type Muon", params, _MUON_PARAMS)
    if params.pop("per_head_muon", False):
        raise ValueError("not implemented yet: optimizer.params.per_head_muon (Newton-Schulz per attention head)")
    if params.get("ns_method", "gram") not in NS_METHODS:
        raise ValueError(f"optimizer.params.ns_method: one of {', '.join(NS_METHODS)}, got {params['ns_method']!r}")
    ns_dtype = params.pop("ns_dtype", "auto")
    if ns_dtype != "auto" and ns_dtype not in _DTYPES:
        raise ValueError(f"optimizer.params.ns_dtype: one of auto, {', '.join(_DTYPES)}, got {ns_dtype!r}")
    adam_w_mode = params.pop("adam_w_mode", True)
    if not isinstance(adam_w_mode, bool):
        raise ValueError(f"optimizer.params.adam_w_mode: must be true or false, got {adam_w_mode!r}")
    for name, value in params.items():
        if name == "betas":
            ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
                isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= b < 1 for b in value)
        elif name == "ns_method":
            ok = True
        else:
            ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and value >= 0
        if not ok:
            raise ValueError(f"optimizer.params.{name}: invalid value {value!r} for optimizer type Muon")
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return Muon(muon_param_groups(groups, params), adam_w_mode=adam_w_mode,
                ns_dtype=None if ns_dtype == "auto" else _DTYPES[ns_dtype])


# ----------------------------------------------------------------------------- schedulers


def build_scheduler(type_name: str, params: dict[str, Any] | None, optimizer: Any) -> Any:
    """Create the LR schedule named by ``scheduler.type`` with ``scheduler.params``.

    DeepSpeed's schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle,
    LRRangeTest) come from this package; any other name is looked up among
    ``torch.optim.lr_scheduler`` classes, as DeepSpeed does.
    """
    if not isinstance(type_name, str) or not type_name:
        raise ValueError(f"scheduler.type: must be a non-empty string, got {type_name!r}")
    params = _drop_auto("scheduler.params", dict(params or {}))
    key = type_name.lower()
    torch_classes = _torch_scheduler_classes()
    if key in _OWN_SCHEDULERS:
        cls = _OWN_SCHEDULERS[key]
    elif key in torch_classes:
        cls = torch_classes[key]
    else:
        valid = [c.__name__ for c in _OWN_SCHEDULERS.values()]
        raise ValueError(
            f"scheduler.type: unknown scheduler {type_name!r}. Valid types: {', '.join(valid)} "
            "(or a torch.optim.lr_scheduler class name)."
            + _did_you_mean(type_name, [*valid, *(c.__name__ for c in torch_classes.values())])
        )

    name = cls.__name__
    accepted = _accepted_params(cls.__init__, skip=("self", "optimizer"))
    _check_names("scheduler.params", f"scheduler type {name}", params, accepted)
    for pname, p in accepted.items():
        if p.default is inspect.Parameter.empty and pname not in params:
            raise ValueError(f"scheduler.params.{pname}: required for scheduler type {name} but not set")
    try:
        return cls(optimizer, **params)
    except ScheduleParamError as err:
        raise ValueError(f"scheduler.params.{err.param}: {err.detail} (scheduler type {name})") from err
    except (ValueError, TypeError) as err:
        raise ValueError(f"{_culprit('scheduler.params', params, err)}: {name} rejected it: {err}") from err
