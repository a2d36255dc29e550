"""Mixed-precision blocks: ``fp16``, ``bf16``, ``amp``, ``torch_autocast``, ``data_types``."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from .base import ConfigModel, DType, Float, Int, OptDType

__all__ = ["FP16Config", "BF16Config", "AmpConfig", "TorchAutocastConfig", "DataTypesConfig"]


class FP16Config(ConfigModel):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: Float = Field(0.0, ge=0)  # 0 means dynamic loss scaling
    initial_scale_power: Int = Field(16, ge=0)
    # the dynamic scaler's settings: checked when it is on (a static scale or fp16 off leaves them unused,
    # and DeepSpeed accepts any value there); torch_autocast fp16 checks them when it builds its scaler
    loss_scale_window: Int = 1000
    hysteresis: Int = Field(2, gt=0)
    consecutive_hysteresis: bool = False
    min_loss_scale: Float = 1.0
    fp16_master_weights_and_grads: bool = False

    @model_validator(mode="after")
    def _check_dynamic_scaler(self) -> "FP16Config":
        if self.enabled and self.loss_scale == 0:
            bad = [k for k in ("loss_scale_window", "min_loss_scale") if getattr(self, k) <= 0]
            if bad:
                raise PydanticCustomError("shardwise_value", "{keys} must be > 0 when dynamic loss scaling is enabled "
                                          "(loss_scale=0)", {"keys": " and ".join(f"fp16.{k}" for k in bad)})
        return self


class BF16Config(ConfigModel):
    enabled: bool = False
    immediate_grad_update: bool = False
    check_grad_overflow: bool = True
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False

    @classmethod
    def unknown_key_hint(cls, key: str) -> str | None:
        if key in FP16Config.model_fields and key not in cls.model_fields:
            return (f"'{key}' is an fp16-only key and is not valid inside 'bf16' "
                    "(bf16 training needs no loss scaling); remove it or move it to 'fp16'")
        return None


class AmpConfig(ConfigModel):
    """NVIDIA Apex AMP passthrough: every key except ``enabled`` goes to ``amp.initialize``."""

    model_config = ConfigDict(extra="allow")
    enabled: bool = False


# DeepSpeed's default (deepspeed.runtime.torch_autocast.get_default_autocast_lower_precision_modules)
_DEFAULT_SAFE_MODULES = ["torch.nn.modules.linear.Linear", "torch.nn.modules.conv.Conv1d",
                         "torch.nn.modules.conv.Conv2d", "torch.nn.modules.conv.Conv3d"]


class TorchAutocastConfig(ConfigModel):
    enabled: bool = False
    dtype: DType = "bf16"
    lower_precision_safe_modules: list[str] = Field(default_factory=lambda: list(_DEFAULT_SAFE_MODULES))


class DataTypesConfig(ConfigModel):
    """DeepSpeed's ``data_types`` block (FSDP's mixed-precision policy in DeepSpeed's words)."""

    grad_accum_dtype: OptDType = None
    # the parameters' dtype; None follows fp16/bf16, and a value that disagrees with them is refused
    param_dtype: OptDType = None
    # the buffers' dtype (rotary inv_freq, running statistics); None keeps each buffer's own dtype
    buffer_dtype: OptDType = None
    # buffers kept in fp32 whatever buffer_dtype says: "auto" reads the model's transformers lists
    # (_keep_in_fp32_modules_strict, and _keep_in_fp32_modules under fp16), or name patterns ("*" any text)
    keep_in_fp32_modules: Literal["auto"] | list[str] = "auto"


def param_dtype_conflict(param_dtype: str | None, *, fp16: bool, bf16: bool) -> str | None:
    """Why ``data_types.param_dtype`` cannot be used with the enabled fp16/bf16 mode, or None when it can:
    the master weights, the reduction and the loss scaling follow the fp16/bf16 flags."""
    trains_in = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    if param_dtype is None or param_dtype == trains_in:
        return None
    return (f"data_types.param_dtype='{param_dtype}' conflicts with the enabled precision mode (the model trains "
            f"in {trains_in}); set the matching fp16/bf16 'enabled' flag or omit data_types.param_dtype")
