"""Muon with an auxiliary AdamW: DeepSpeed's ``"optimizer": {"type": "Muon"}``.

Muon (MomentUm Orthogonalized by Newton-Schulz) steps hidden 2-D weight matrices; everything else
(embeddings, the LM head, norms, biases) is stepped by AdamW inside the same optimizer. Which half a
parameter belongs to is its ``use_muon`` attribute: ``tag_muon_params`` sets it as DeepSpeed does (2-D or
more, and no ``embed`` / ``lm_head`` in the name) on every parameter that does not have one yet.

For a Muon matrix ``W`` with gradient ``G`` and momentum ``M`` (group ``lr``, ``momentum`` beta, ``weight_decay``)::

    M = lerp(M, G, 1 - beta);   U = lerp(G, M, beta)           # Nesterov
    O = NS5(U) * sqrt(max(1, rows / cols))                      # Newton-Schulz, 5 quintic steps
    W = W * (1 - lr * weight_decay) - lr * O

(4-D convolution weights are viewed as ``rows x rest``.) ``ns_method`` ``gram`` iterates on the small
Gram matrix ``X X^T`` (same result in exact arithmetic, fewer FLOPs on wide matrices), ``standard`` on
``X``. The AdamW half is bias-corrected AdamW with ``eps`` outside the square root.

Under ZeRO 1-3 the optimizer holds 1-D fragments of the weights. The momentum and ``U`` are element-wise,
so each rank computes them on its fragments; ``U`` of every Muon matrix is then assembled whole with one
all-reduce over the data-parallel group (each element comes from the one rank that owns it), each rank
orthogonalizes the matrices it holds a piece of, and applies its slice of ``O``. The result is one
process's Muon on the whole matrices.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from shardwise import comm

__all__ = ["Muon", "tag_muon_params", "orthogonalize", "muon_param_groups"]

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def _layer_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape as a layer (a ZeRO-3 parameter's ``ds_shape``, not its placeholder)."""
    return tuple(getattr(p, "ds_shape", None) or p.shape)


def tag_muon_params(module: torch.nn.Module) -> None:
    """DeepSpeed's split, for parameters that carry no ``use_muon`` yet (a value set by the user wins)."""
    for name, p in module.named_parameters():
        if not hasattr(p, "use_muon"):
            lowered = name.lower()
            p.use_muon = len(_layer_shape(p)) >= 2 and "embed" not in lowered and "lm_head" not in lowered


def muon_param_groups(model_parameters: Iterable, params: dict[str, Any]) -> list[dict[str, Any]]:
    """Split each incoming group into a Muon half and an AdamW half (DeepSpeed's ``_muon_param_groups``):
    the config's shared value, then ``muon_lr`` / ``adam_lr``, then the group's own setting."""
    groups, loose = [], []
    for item in model_parameters:
        (groups if isinstance(item, dict) else loose).append(item)
    if loose or not groups:
        groups.append({"params": loose})
    untagged = [p for g in groups for p in g["params"] if not hasattr(p, "use_muon")]
    if untagged:
        raise ValueError(f"optimizer.type=Muon: {len(untagged)} parameter(s) have no use_muon attribute; they "
                         "are not parameters of the model given to initialize(). Set p.use_muon = True/False")
    halves = []
    for use_muon, label, keys, override in ((True, "muon", MUON_KEYS, "muon_lr"), (False, "adam", ADAM_KEYS, "adam_lr")):
        shared = {k: params[k] for k in keys if k in params}
        if override in params:
            shared["lr"] = params[override]
        halves.append((use_muon, label, keys, shared))
    out = []
    for index, group in enumerate(groups):
        own = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys, shared in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if half:
                prefix = own.get("name") or (f"group{index}" if len(groups) > 1 else None)
                settings = {**shared, **{k: v for k, v in own.items() if k in keys}}
                out.append(dict(params=half, use_muon=use_muon, name=f"{prefix}-{label}-params" if prefix
                                else f"{label}-params", **settings))
    return out


def _auto_ns_dtype(method: str, device: torch.device) -> torch.dtype:
    """DeepSpeed's choice: ``gram`` in fp16 where the device supports it, ``standard`` in bf16; else fp32."""
    if method == "gram":
        if device.type == "cuda":
            return torch.float16
        if device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:
                return torch.float16 if torch.ops.mkldnn._is_mkldnn_fp16_supported() else torch.float32
            except (AttributeError, RuntimeError):
                return torch.float32
        return torch.float32
    return torch.bfloat16


def orthogonalize(update: torch.Tensor, *, method: str = "gram", dtype: torch.dtype = torch.float32,
                  steps: int = 5) -> torch.Tensor:
    """Newton-Schulz orthogonalization of a 2-D matrix, times ``sqrt(max(1, rows / cols))``, in
    ``update``'s dtype. Computed in ``dtype``; as DeepSpeed, ``gram`` normalises before the cast (in fp32
    when ``update`` is fp16), ``standard`` after it."""
    rows, cols = update.shape
    if method == "standard":
        x = update.to(dtype)
    else:
        x = update.float() if update.dtype == torch.float16 else update
    if rows > cols:
        x = x.mT
    x = (x / (x.norm() + 1e-7)).to(dtype)
    a, b, c = NS_COEFFS
    if method == "standard" or x.size(0) == x.size(1):
        for _ in range(steps):
            gram = x @ x.mT
            x = a * x + (b * gram + c * gram @ gram) @ x
    else:
        x = _gram_newton_schulz(x, steps)
    if rows > cols:
        x = x.mT
    scale = math.sqrt(rows / cols) if rows > cols else 1.0
    return (x * scale).to(update.dtype)


def _gram_newton_schulz(x: torch.Tensor, steps: int, restart: int = 2) -> torch.Tensor:
    """The iteration ``X <- (aI + bR + cR^2) X`` with ``R = X X^T``, carried as ``X_k = Q X_0`` so only the
    small ``R`` and ``Q`` are multiplied; at step ``restart`` ``X`` is formed once to limit round-off."""
    a, b, c = NS_COEFFS
    r = x @ x.mT
    q = None
    for i in range(steps):
        if i == restart and q is not None:
            x, q = q @ x, None
            r = x @ x.mT
        z = b * r + c * r @ r
        q = z + a * torch.eye(z.size(0), dtype=z.dtype, device=z.device) if q is None else a * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = a * r + z @ r  # R <- (aI + Z) R (aI + Z): Z is a polynomial in R, so they commute
            r = a * rz + z @ rz
    return q @ x


class Muon(torch.optim.Optimizer):
    """DeepSpeed's ``MuonWithAuxAdam``: groups carry ``use_muon``; Muon groups ``lr``, ``momentum``,
    ``weight_decay``, ``ns_method``; AdamW groups ``lr``, ``betas``, ``eps``, ``weight_decay``.
    ``adam_w_mode`` False makes the AdamW half Adam with L2 weight decay. ``ns_dtype`` (shardwise's):
    the Newton-Schulz dtype, ``None`` for DeepSpeed's choice by device."""

    def __init__(self, param_groups: list[dict[str, Any]], *, adam_w_mode: bool = True,
                 ns_dtype: torch.dtype | None = None) -> None:
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError("Muon: every param group needs use_muon (see muon_param_groups)")
            defaults = MUON_DEFAULTS if group["use_muon"] else ADAM_DEFAULTS
            for key, value in defaults.items():
                group.setdefault(key, value)
            if group["use_muon"] and group["ns_method"] not in NS_METHODS:
                raise ValueError(f"ns_method must be one of {', '.join(NS_METHODS)}, got {group['ns_method']!r}")
            for p in group["params"] if group["use_muon"] else ():
                if len(_layer_shape(p)) < 2:
                    raise ValueError(f"Muon: a parameter of shape {_layer_shape(p)} has use_muon set; Muon steps "
                                     "matrices only (set p.use_muon = False on it)")
        super().__init__(param_groups, {})
        self.adam_w_mode = adam_w_mode
        self.ns_dtype = ns_dtype
        # the whole Muon matrices, in the same order on every rank (ZeRO swaps the groups' tensors)
        self._whole = [p for g in self.param_groups if g["use_muon"] for p in g["params"]]
        self._dp_group = None
        self._partitioned = False

    def partitioned(self, *, dp_group) -> None:
        """Called by ZeRO 1-3 after the groups' tensors became 1-D fragments of the weights
        (with ``zero_whole`` and ``zero_range``): steps assemble Muon updates over ``dp_group``."""
        self._dp_group = dp_group
        self._partitioned = True

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        fragments = []
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adam(group)
                continue
            for p in group["params"]:
                if hasattr(p, "zero_whole"):
                    fragments.append((p, group))
                else:
                    self._muon_whole(p, group)
        if self._partitioned:
            self._muon_fragments(fragments)
        return loss

    # -- Muon --------------------------------------------------------------------------------
    def _direction(self, p: torch.Tensor, group) -> torch.Tensor:
        """Momentum (element-wise, in place) and the Nesterov direction ``U``; a non-finite gradient
        leaves the momentum alone (the loss scaler skips that step)."""
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, beta = state["momentum_buffer"], group["momentum"]
        finite = torch.isfinite(grad).all()
        buf.copy_(torch.where(finite, buf.lerp(grad, 1 - beta), buf))
        return grad.lerp(buf, beta)

    def _orthogonalized(self, update: torch.Tensor, shape: tuple[int, ...], group) -> torch.Tensor:
        matrix = update.reshape(shape[0], -1)
        dtype = self.ns_dtype or _auto_ns_dtype(group["ns_method"], update.device)
        return orthogonalize(matrix, method=group["ns_method"], dtype=dtype)

    @staticmethod
    def _apply(p: torch.Tensor, update: torch.Tensor, group) -> None:
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.reshape(p.shape), alpha=-group["lr"])

    def _muon_whole(self, p: torch.Tensor, group) -> None:
        self._apply(p, self._orthogonalized(self._direction(p, group), tuple(p.shape), group), group)

    def _muon_fragments(self, fragments: list) -> None:
        """ZeRO 1-3: assemble every Muon matrix's ``U`` with one all-reduce, orthogonalize the ones this
        rank holds a piece of, apply this rank's slices. Collective over the data-parallel group."""
        offsets, total = {}, 0
        for w in self._whole:
            offsets[id(w)] = total
            total += math.prod(_layer_shape(w))
        device = fragments[0][0].device if fragments else (self._whole[0].device if self._whole else "cpu")
        flat = torch.zeros(total, dtype=torch.float32, device=device)
        mine: dict[int, list] = {}
        for p, group in fragments:
            start, end = p.zero_range
            at = offsets[id(p.zero_whole)]
            flat[at + start: at + end] = self._direction(p, group).float()
            mine.setdefault(id(p.zero_whole), []).append((p, group))
        comm.all_reduce(flat, group=self._dp_group)
        for w in self._whole:
            pieces = mine.get(id(w))
            if not pieces:
                continue
            shape, at = _layer_shape(w), offsets[id(w)]
            whole = self._orthogonalized(flat[at: at + math.prod(shape)], shape, pieces[0][1]).reshape(-1)
            for p, group in pieces:
                start, end = p.zero_range
                self._apply(p, whole[start:end].to(p.dtype), group)

    # -- the AdamW half ------------------------------------------------------------------------
    def _adam(self, group) -> None:
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            if not self.adam_w_mode:
                grad = grad.add(p, alpha=group["weight_decay"])
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = float(state["step"])
            state["exp_avg"].lerp_(grad, 1 - beta1)
            state["exp_avg_sq"].lerp_(grad.square(), 1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
            if self.adam_w_mode:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1 ** step))
