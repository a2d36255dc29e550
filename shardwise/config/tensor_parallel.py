"""The ``tensor_parallel`` block: DeepSpeed's ``TPTrainingConfig`` (AutoTP training).

Every key of DeepSpeed 0.19.8's block is accepted. The ones shardwise honours are
``autotp_size``, ``dtype``, ``tp.tp_size`` (must agree with ``autotp_size``), ``tp.tp_grain_size``
(only matters for uneven splits, which AutoTP refuses) and ``keep_module_on_host``; the others
are refused by ``check_supported()`` when switched on (see ``support.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, Optional

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from .base import ConfigModel, Int, OptDType, case_insensitive

if TYPE_CHECKING:  # pragma: no cover
    from .loader import Report

__all__ = ["TensorParallelConfig", "TPConfig", "AUTOTP_PRESETS"]

# DeepSpeed's presets whose layer roles shardwise's AutoTP covers with its built-in rules
AUTOTP_PRESETS = ("llama", "qwen2")


class TPConfig(ConfigModel):
    """``tensor_parallel.tp`` (alias ``tensor_parallel.tensor_parallel``): DeepSpeed's ``TPConfig``."""

    tp_size: Annotated[Int, Field(ge=1)] = 1
    tp_grain_size: Annotated[Int, Field(ge=1)] = 1
    mpu: Optional[Any] = None  # objects, not JSON: only None is meaningful in a config file
    tp_group: Optional[Any] = None

    @model_validator(mode="after")
    def _objects_unset(self) -> "TPConfig":
        for name in ("mpu", "tp_group"):
            if getattr(self, name) is not None:
                raise PydanticCustomError(
                    "shardwise_value",
                    f"tensor_parallel.tp.{name} cannot be given in the config: shardwise builds the tensor-parallel "
                    "group from tensor_parallel.autotp_size (pass an mpu to initialize(mpu=...) instead)")
        return self


class TensorParallelConfig(ConfigModel):
    """AutoTP training: ``{"tensor_parallel": {"autotp_size": 2}}`` shards a Hugging Face model."""

    autotp_size: Annotated[Int, Field(ge=0)] = 0
    dtype: OptDType = None
    tp_overlap_comm: bool = False
    vocab_parallel_lm_head: Optional[bool] = None
    vocab_parallel_ce_backend: Annotated[Literal["torch", "liger"], case_insensitive("torch", "liger")] = "torch"
    tp: TPConfig = Field(default_factory=TPConfig)
    injection_policy_tuple: Optional[Any] = None
    partition_config: Optional[dict[str, Any]] = None
    preset_model: Optional[str] = None
    keep_module_on_host: bool = False
    replace_with_kernel_inject: bool = False

    # DeepSpeed's pydantic aliases (not deprecated spellings: both are current)
    aliases: ClassVar[dict[str, str]] = {"tensor_parallel": "tp", "kernel_inject": "replace_with_kernel_inject"}

    @classmethod
    def upgrade(cls, data: dict[str, Any], path: str, report: "Report") -> dict[str, Any]:
        for alias, name in cls.aliases.items():
            if alias not in data:
                continue
            if name in data:
                report.problem(f"{path}.{alias} and {path}.{name} are the same key (DeepSpeed alias); keep one")
                data.pop(alias)
            else:
                data[name] = data.pop(alias)
        return data

    @model_validator(mode="after")
    def _sizes_agree(self) -> "TensorParallelConfig":
        if self.tp.tp_size not in (1, self.autotp_size):
            raise PydanticCustomError(
                "shardwise_conflict",
                f"tensor_parallel.tp.tp_size ({self.tp.tp_size}) does not match tensor_parallel.autotp_size "
                f"({self.autotp_size}); give only autotp_size")
        return self

    @property
    def enabled(self) -> bool:
        return self.autotp_size > 1
