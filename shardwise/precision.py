"""Mixed-precision policy, loss scaling, and the step's unscale / overflow check / clipping.

Every ZeRO stage computes the squared norm of the gradients it holds with ``grad_sq_sum``,
sums it over the ranks that hold pieces, and lets ``unscale_and_clip`` decide the overflow
and the one coefficient (unscale x clip) applied before the optimizer steps.

The dynamic loss scaler follows DeepSpeed's rules (``fp16`` config block):

* On an overflow step the scale is not cut right away: ``delayed_shift``
  (``fp16.hysteresis``) overflows are tolerated first, each consuming one unit
  of hysteresis. Once it is used up (or ``delayed_shift == 1``) every further
  overflow divides the scale by ``scale_factor``, never going below
  ``min_scale``. An overflow while already at ``min_scale`` with the
  hysteresis used up raises ``RuntimeError`` (unless
  ``raise_error_at_min_scale=False``).
* Every update increments an iteration counter. On a clean update, with
  ``stable = iteration - last_overflow_iteration - 1`` (the last overflow
  iteration starts at -1), the scale is multiplied by ``scale_factor``
  whenever ``stable > 0`` and ``stable % scale_window == 0``; the hysteresis
  is refilled at that moment. With ``consecutive_hysteresis`` the hysteresis
  is refilled on every clean update instead, so only consecutive overflows
  count.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

logger = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}  # the config's dtype names


class _LossScaler:
    cur_scale: float

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.cur_scale


class StaticLossScaler(_LossScaler):
    """A fixed loss scale (``fp16.loss_scale`` > 0, or 1.0 when not using fp16)."""

    dynamic = False

    def __init__(self, scale: float = 1.0) -> None:
        if not scale > 0:
            raise ValueError(f"scale: a static loss scale must be > 0, got {scale!r}")
        self.cur_scale = float(scale)

    def update_scale(self, overflow: bool) -> None:
        """A static scale never changes."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "static", "cur_scale": self.cur_scale}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restoring keeps the configured scale; the saved one is only checked for the kind."""
        _check_kind(sd, "static")


class DynamicLossScaler(_LossScaler):
    """Loss scale that shrinks on overflow and grows after ``scale_window`` clean steps."""

    dynamic = True

    def __init__(
        self,
        *,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 2,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale: must be > 0, got {init_scale!r}")
        if not scale_factor > 1:
            raise ValueError(f"scale_factor: must be > 1, got {scale_factor!r}")
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(f"scale_window: must be a positive integer, got {scale_window!r}")
        if not min_scale > 0:
            raise ValueError(f"min_scale: must be > 0, got {min_scale!r}")
        if isinstance(delayed_shift, bool) or not isinstance(delayed_shift, int) or delayed_shift < 1:
            raise ValueError(f"delayed_shift: must be an integer >= 1, got {delayed_shift!r}")
        self.cur_scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = scale_window
        self.min_scale = float(min_scale)
        self.delayed_shift = delayed_shift
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = delayed_shift

    def update_scale(self, overflow: bool) -> None:
        """Record one optimizer step's outcome (True: gradients had inf/NaN and the step was skipped)."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise RuntimeError(
                        f"fp16 gradients keep overflowing at the minimum loss scale ({self.min_scale:g}); "
                        "training cannot continue. Try a lower learning rate, gradient clipping "
                        "('gradient_clipping'), bf16 instead of fp16, checking the data and model for "
                        "inf/NaN, or a smaller 'fp16.min_loss_scale'."
                    )
                new_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                logger.debug("fp16 overflow: skipping step, loss scale %g -> %g", self.cur_scale, new_scale)
                self.cur_scale = new_scale
            else:
                logger.debug(
                    "fp16 overflow: skipping step at loss scale %g, hysteresis %d -> %d",
                    self.cur_scale,
                    self.cur_hysteresis,
                    self.cur_hysteresis - 1,
                )
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "type": "dynamic",
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Restore the running state; the hyperparameters stay as configured for this run."""
        _check_kind(sd, "dynamic")
        missing = [k for k in ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis") if k not in sd]
        if missing:
            raise ValueError(f"loss scaler state: missing keys {missing}")
        self.cur_scale = float(sd["cur_scale"])
        self.cur_iter = int(sd["cur_iter"])
        self.last_overflow_iter = int(sd["last_overflow_iter"])
        self.cur_hysteresis = min(int(sd["cur_hysteresis"]), self.delayed_shift)


def _check_kind(sd: Mapping[str, Any], expected: str) -> None:
    kind = sd.get("type")
    if kind != expected:
        raise ValueError(
            f"loss scaler state is for a {kind!r} scaler but this run uses a {expected!r} one "
            "(fp16.loss_scale: 0 means dynamic, > 0 static)"
        )


def create_loss_scaler(fp16_cfg: Any) -> DynamicLossScaler | StaticLossScaler:
    """The scaler described by an ``fp16`` config block (``None`` gives a static scale of 1)."""
    if fp16_cfg is None:
        return StaticLossScaler(1.0)
    loss_scale = fp16_cfg.loss_scale
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or loss_scale < 0:
        raise ValueError(f"fp16.loss_scale: must be a number >= 0 (0 = dynamic), got {loss_scale!r}")
    if loss_scale > 0:
        return StaticLossScaler(float(loss_scale))
    checks = {
        "initial_scale_power": (fp16_cfg.initial_scale_power, 0),
        "loss_scale_window": (fp16_cfg.loss_scale_window, 1),
        "hysteresis": (fp16_cfg.hysteresis, 1),
    }
    for key, (value, low) in checks.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"fp16.{key}: must be an integer >= {low}, got {value!r}")
    min_loss_scale = fp16_cfg.min_loss_scale
    if isinstance(min_loss_scale, bool) or not isinstance(min_loss_scale, (int, float)) or min_loss_scale <= 0:
        raise ValueError(f"fp16.min_loss_scale: must be a number > 0, got {min_loss_scale!r}")
    return DynamicLossScaler(
        init_scale=2.0**fp16_cfg.initial_scale_power,
        scale_window=fp16_cfg.loss_scale_window,
        min_scale=float(min_loss_scale),
        delayed_shift=fp16_cfg.hysteresis,
        consecutive_hysteresis=bool(fp16_cfg.consecutive_hysteresis),
    )


@dataclass(frozen=True)
class StepResult:
    grad_norm: float  # global L2 norm of the unscaled gradients, before clipping
    overflow: bool  # True: inf/nan found, the optimizer step was skipped


def grad_sq_sum(tensors: Iterable[torch.Tensor], piece: int = 1 << 24) -> torch.Tensor:
    """Sum of squares of every element, in fp32 (a 16-bit tensor is widened a slice at a time, so no
    full-size fp32 copy is made and large finite fp16 values do not overflow)."""
    total = None
    for t in tensors:
        flat = t.reshape(-1)
        if flat.dtype == torch.float32:
            part = torch.linalg.vector_norm(flat).square()
        else:
            part = torch.zeros((), dtype=torch.float32, device=t.device)
            for i in range(0, flat.numel(), piece):
                part += flat[i : i + piece].float().square().sum()
        total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=torch.float32)


def unscale_and_clip(sq_sum: torch.Tensor, *, loss_scale: float, clip: float,
                     check_overflow: bool) -> tuple[float, float | None]:
    """From the global sum of squares of the *scaled* gradients: ``(norm, coef)``.

    ``norm`` is the L2 norm of the unscaled gradients (before clipping); ``coef`` the single factor to
    multiply the scaled gradients by (unscale, and clip to ``clip`` as ``torch.nn.utils.clip_grad_norm_``
    does), or ``None`` when ``check_overflow`` finds inf/NaN (the step is then skipped).  The sum is
    global (all-reduced over the ranks holding pieces), so every rank decides the same."""
    total = sq_sum.sqrt() / loss_scale
    if check_overflow and not bool(torch.isfinite(total)):
        return float("inf"), None
    norm = float(total)
    coef = 1.0 / loss_scale
    if clip > 0 and clip / (norm + 1e-6) < 1.0:
        coef *= clip / (norm + 1e-6)
    return norm, coef


def apply_coefficient_(grads: list[torch.Tensor], coef: float) -> None:
    """Multiply the gradients in place by the factor ``unscale_and_clip`` returned."""
    if coef != 1.0 and grads:
        torch._foreach_mul_(grads, coef)


@torch.no_grad()
def total_norm(tensors: Iterable[torch.Tensor], norm_type: float = 2.0, *, model_group=None,
               device: torch.device | None = None) -> torch.Tensor:
    """The ``norm_type`` norm of ``tensors`` taken as one vector (fp32), a 0-dim tensor (on ``device`` when
    there are none). ``model_group``: the ranks holding different slices of one model combine theirs (summed
    powers; the largest, for ``inf``)."""
    from shardwise import comm

    tensors = [t.detach() for t in tensors]
    norm_type = float(norm_type)
    device = tensors[0].device if tensors else (device or torch.device("cpu"))
    if norm_type == float("inf"):
        total = torch.stack([t.abs().max().float() for t in tensors]).max() if tensors \
            else torch.zeros((), device=device)
        if model_group is not None:
            comm.all_reduce(total, op=comm.ReduceOp.MAX, group=model_group)
        return total
    norms = [t.float().norm(norm_type) for t in tensors]
    total = torch.stack(norms).pow(norm_type).sum() if norms else torch.zeros((), device=device)
    if model_group is not None:
        comm.all_reduce(total, group=model_group)
    return total.pow(1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, *, model_group=None,
                    count_replicated: bool = True, average_group=None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their total ``norm_type`` norm is at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_``'s coefficient, ``max_norm / (norm + 1e-6)`` capped at 1); returns the
    total norm as a tensor. For a stand-alone call outside the engine (the engine clips in its step).

    ``model_group``: the ranks holding different slices of one model (tensor, pipe): their norms combine
    (summed powers; the largest, for ``inf``). ``count_replicated=False``: this rank leaves out the parameters
    that are not tensor-sharded (another rank of ``model_group`` counts them). ``average_group``: the norm is
    then averaged over that group (ranks holding different experts agree on one coefficient)."""
    from shardwise import comm

    params = [p for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters) if p.grad is not None]
    counted = params if float(norm_type) == float("inf") else \
        [p for p in params if count_replicated or _sharded(p)]
    total = total_norm([p.grad for p in counted], norm_type, model_group=model_group,
                       device=params[0].grad.device if params else None)
    if average_group is not None and comm.get_world_size(average_group) > 1:
        total = total / comm.get_world_size(average_group)
        comm.all_reduce(total, group=average_group)
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.to(p.grad.device))
    return total


def _sharded(p: torch.Tensor) -> bool:
    """A tensor-sharded parameter (Megatron's ``tensor_model_parallel``, or its older ``model_parallel``)."""
    return bool(getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False))


@dataclass(frozen=True)
class PrecisionPolicy:
    """What dtype the model runs in and which mixed-precision machinery is on.

    ``master_weights``: the optimizer updates an fp32 copy of the 16-bit params.
    ``loss_scaling``: losses are scaled (fp16 only). ``auto_cast``: floating-point
    inputs are cast to fp16 before forward. ``check_overflow``: steps with inf/NaN
    gradients are skipped. ``grad_accum_dtype``: the dtype gradients accumulate in over the
    micro-steps (``data_types.grad_accum_dtype``; None: ``param_dtype``, DeepSpeed's default).
    """

    param_dtype: torch.dtype = torch.float32
    master_weights: bool = False
    loss_scaling: bool = False
    auto_cast: bool = False
    check_overflow: bool = False
    grad_accum_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None  # data_types.buffer_dtype; None: buffers keep their own dtype

    @property
    def accum_dtype(self) -> torch.dtype:
        """The dtype of the gradient accumulation buffers."""
        return self.grad_accum_dtype or self.param_dtype

    @classmethod
    def from_config(cls, cfg: Any) -> PrecisionPolicy:
        policy = cls._from_mixed_precision(cfg)
        data_types = getattr(cfg, "data_types", None)
        accum = getattr(data_types, "grad_accum_dtype", None)
        if accum is not None:
            dtype = DTYPES[accum]
            policy = replace(policy, grad_accum_dtype=None if dtype == policy.param_dtype else dtype)
        buffers = getattr(data_types, "buffer_dtype", None)
        if buffers is not None:
            policy = replace(policy, buffer_dtype=DTYPES[buffers])
        return policy

    @classmethod
    def _from_mixed_precision(cls, cfg: Any) -> PrecisionPolicy:
        fp16 = getattr(cfg, "fp16", None)
        bf16 = getattr(cfg, "bf16", None)
        fp16_on = bool(fp16 is not None and fp16.enabled)
        bf16_on = bool(bf16 is not None and bf16.enabled)
        if fp16_on and bf16_on:
            raise ValueError("fp16.enabled and bf16.enabled: both are true; enable at most one")
        if fp16_on:
            return cls(
                param_dtype=torch.float16,
                master_weights=not getattr(fp16, "fp16_master_weights_and_grads", False),
                loss_scaling=True,
                auto_cast=bool(getattr(fp16, "auto_cast", False)),
                check_overflow=True,
            )
        if bf16_on:
            return cls(
                param_dtype=torch.bfloat16,
                master_weights=not getattr(bf16, "bf16_master_weights_and_grads", False),
                loss_scaling=False,
                auto_cast=False,
                check_overflow=bool(getattr(bf16, "check_grad_overflow", True)),
            )
        autocast = getattr(cfg, "torch_autocast", None)
        if autocast is not None and autocast.enabled and autocast.dtype == "fp16":
            # fp32 weights, fp16 activations: dynamic loss scaling as DeepSpeed's GradScaler (the fp16
            # block's scaler settings), so small fp16 activation gradients do not flush to zero
            return cls(loss_scaling=True, check_overflow=True)
        return cls()


def cast_inputs(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor inside (nested) tuples, lists and dicts to ``dtype``.

    Other values (integer tensors, strings, None, ...) are returned unchanged; container
    types (including namedtuples and dict subclasses) are preserved.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(cast_inputs(v, dtype) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_inputs(v, dtype) for v in obj)
    if isinstance(obj, dict):
        out = obj.copy()  # keeps the mapping type (OrderedDict, defaultdict, ...)
        for key, value in obj.items():
            out[key] = cast_inputs(value, dtype)
        return out
    return obj
