"""``deepspeed.module_inject.autotp_config``: DeepSpeed's custom AutoTP partition config -- ``TPLayerSpec``
(regex patterns over parameter names, column / row / skip, an optional sub-parameter ``shape``),
``AutoTPConfig`` (the specs, first match wins; ``from_dict`` reads ``tensor_parallel.partition_config``'s
JSON form) and ``merge_autotp_configs``. ``deepspeed.module_inject.auto_tp.AutoTP(...,
partition_config=...)`` shards by these specs with the layer classes of ``deepspeed.module_inject.layers``
(shardwise's AutoTP layers). DeepSpeed's model presets (``AutoTPPresets``) are not provided."""
from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import List, Optional, Tuple, Union

__all__ = ["AutoTPConfig", "PartitionType", "TPLayerSpec", "merge_autotp_configs"]

logger = logging.getLogger("shardwise")


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


class PartitionType(Enum):
    COLUMN = "column"  # output dimension split (all-reduce of the input gradient)
    ROW = "row"  # input dimension split (output all-reduced)
    SKIP = "skip"  # left whole


@dataclass
class TPLayerSpec:
    """How the layers whose parameter names match ``patterns`` (``re.match``) are split. ``shape`` views the
    weight as sub-parameters: ``(3, -1)`` three equal ones, ``((q, k, v), -1)`` three of those sizes (one level
    of nesting, at ``partition_dim``); ``partition_dim`` defaults to 0 for COLUMN and 1 for ROW;
    ``model_types`` limits the spec to those models (``config.model_type``); ``gather_output`` all-gathers a
    column-parallel output; ``grad_allreduce`` (SKIP only) sums a replicated parameter's gradient over the
    tensor group."""

    patterns: List[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: Optional[Tuple[Union[int, Tuple[int, ...]], ...]] = None
    partition_dim: Optional[int] = None
    model_types: Optional[List[str]] = None
    gather_output: bool = False
    grad_allreduce: bool = False

    def __post_init__(self):
        if isinstance(self.partition_type, str):
            self.partition_type = PartitionType(self.partition_type.lower())
        if self.shape is not None:
            self.shape = self._normalize_shape(self.shape)
            self._validate_shape_format()

    @staticmethod
    def _normalize_shape(shape):
        if isinstance(shape, list):
            return tuple(TPLayerSpec._normalize_shape(item) for item in shape)
        if isinstance(shape, tuple):
            return tuple(TPLayerSpec._normalize_shape(item) if isinstance(item, list) else item for item in shape)
        return shape

    def _validate_shape_format(self):
        if not isinstance(self.shape, tuple):
            raise ValueError("AutoTP shape must be a tuple of ints or a tuple at partition_dim.")
        dim = self.get_partition_dim()
        if dim < 0 or dim >= len(self.shape):
            raise ValueError(f"AutoTP partition_dim {dim} is out of range for shape length {len(self.shape)}.")
        nested = False
        for idx, size in enumerate(self.shape):
            if isinstance(size, tuple):
                if idx != dim:
                    raise ValueError(f"AutoTP shape nested tuple only allowed at partition_dim={dim}, got at {idx}.")
                if nested:
                    raise ValueError("AutoTP shape supports only 1-level nesting at partition_dim.")
                nested = True
                if not size:
                    raise ValueError("AutoTP shape nested tuple cannot be empty.")
                for val in size:
                    if isinstance(val, tuple):
                        raise ValueError("AutoTP shape supports only 1-level nesting at partition_dim.")
                    if not isinstance(val, int) or val <= 0:
                        raise ValueError("AutoTP nested sub-parameter sizes must be positive integers.")
            elif isinstance(size, int):
                if size == 0 or size < -1:
                    raise ValueError("AutoTP shape dimensions must be positive integers or -1.")
            else:
                raise ValueError("AutoTP shape must contain only integers or a tuple at partition_dim.")

    def get_partition_dim(self) -> int:
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type == PartitionType.COLUMN else 1

    def has_unequal_sub_params(self) -> bool:
        if self.shape is None:
            return False
        dim = self.get_partition_dim()
        return dim < len(self.shape) and isinstance(self.shape[dim], tuple)

    def get_sub_param_sizes(self) -> Optional[Tuple[int, ...]]:
        return self.shape[self.get_partition_dim()] if self.has_unequal_sub_params() else None

    def get_num_sub_params(self) -> Optional[int]:
        if self.shape is None:
            return None
        dim = self.get_partition_dim()
        if dim >= len(self.shape):
            return None
        size = self.shape[dim]
        if isinstance(size, tuple):
            return len(size)
        return size if isinstance(size, int) and size > 0 else None

    def matches(self, param_name: str, model_type: Optional[str] = None) -> bool:
        if self.model_types:
            if model_type is None or str(model_type).lower() not in [str(m).lower() for m in self.model_types]:
                return False
        return any(re.match(pattern, param_name) for pattern in self.patterns)


@dataclass
class AutoTPConfig:
    """The layer specs of a custom AutoTP partition (the first matching spec applies)."""

    tp_size: int = 1
    layer_specs: List[TPLayerSpec] = field(default_factory=list)
    embedding_partition_dim: int = 1
    lm_head_patterns: List[str] = field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    strict_mode: bool = False  # an unmatched linear layer is an error

    def find_matching_spec(self, param_name: str, model_type: Optional[str] = None) -> Optional[TPLayerSpec]:
        matches = [spec for spec in self.layer_specs if spec.matches(param_name, model_type)]
        if not matches:
            return None
        if len(matches) > 1:
            _warn_once(f"AutoTPConfig: parameter {param_name} matched multiple layer_specs "
                       f"{[spec.patterns for spec in matches]}; using the first match.")
        return matches[0]

    @classmethod
    def from_dict(cls, config_dict: dict) -> "AutoTPConfig":
        """The config of ``tensor_parallel.partition_config`` (JSON: ``partition_type`` a string, shapes lists)."""
        specs = []
        for spec in config_dict.get("layer_specs", []):
            kind = spec.get("partition_type", "column")
            shape = spec.get("shape")
            specs.append(TPLayerSpec(
                patterns=spec.get("patterns", []),
                partition_type=PartitionType(kind.lower()) if isinstance(kind, str) else kind,
                gather_output=spec.get("gather_output", False), grad_allreduce=spec.get("grad_allreduce", False),
                shape=cls._convert_shape(shape) if shape is not None else None,
                partition_dim=spec.get("partition_dim"), model_types=spec.get("model_types")))
        return cls(tp_size=config_dict.get("tp_size", 1), layer_specs=specs,
                   embedding_partition_dim=config_dict.get("embedding_partition_dim", 1),
                   lm_head_patterns=config_dict.get("lm_head_patterns", ["lm_head", "embed_out"]),
                   use_default_specs=config_dict.get("use_default_specs", True),
                   strict_mode=config_dict.get("strict_mode", False))

    @staticmethod
    def _convert_shape(shape):
        if isinstance(shape, list):
            return tuple(AutoTPConfig._convert_shape(item) if isinstance(item, list) else item for item in shape)
        return shape


def merge_autotp_configs(base: AutoTPConfig, override: AutoTPConfig) -> AutoTPConfig:
    """``override``'s specs first (they win), then ``base``'s."""
    return AutoTPConfig(tp_size=override.tp_size if override.tp_size > 1 else base.tp_size,
                        layer_specs=list(override.layer_specs) + list(base.layer_specs),
                        embedding_partition_dim=override.embedding_partition_dim,
                        lm_head_patterns=override.lm_head_patterns or base.lm_head_patterns,
                        use_default_specs=override.use_default_specs, strict_mode=override.strict_mode)
