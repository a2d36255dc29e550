"""``deepspeed.runtime.zenflow.zenflow_config``: ``ZenFlowConfig``, the ``zero_optimization.zenflow`` block
with DeepSpeed's fields, defaults and checks. The block parses (``DeepSpeedZeroConfig(zenflow={...})``);
shardwise's engine refuses to run ZenFlow (``shardwise.config.zero.ZeroConfig`` names the key)."""
from __future__ import annotations

from typing import Optional, Union

from pydantic import Field, model_validator

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

__all__ = ["ZenFlowConfig"]


class ZenFlowConfig(DeepSpeedConfigModel):
    """ZenFlow's settings: which gradient columns count as important and how often the rest are applied."""

    topk_ratio: float = Field(0.1, gt=0.0, lt=1.0)
    select_strategy: str = "auto"  # "auto", "step" or "epoch"
    select_interval: Union[str, int] = "auto"
    update_interval: Union[str, int] = "auto"
    overlap_step: bool = False
    offload: bool = False
    auto_ratio: float = Field(0.99, ge=0.0, le=1.0)
    full_warm_up_rounds: int = 0
    pt_reserved_cores_perc: float = Field(0.5, ge=0.0, le=1.0)
    steps_per_epoch: Optional[int] = Field(default=None, exclude=True)  # set while running, not by users

    @model_validator(mode="after")
    def validate_fields(self):
        if self.select_strategy not in ("auto", "step", "epoch"):
            raise ValueError('select_strategy must be one of "auto", "step", or "epoch"')
        if isinstance(self.select_interval, str) and self.select_interval != "auto":
            raise ValueError('If select_interval is a string, it must be "auto"')
        if isinstance(self.update_interval, str) and self.update_interval != "auto":
            raise ValueError('If update_interval is a string, it must be "auto"')
        if isinstance(self.update_interval, int) and self.update_interval < 1:
            raise ValueError("If update_interval is a number, it must be at least 1")
        return self
