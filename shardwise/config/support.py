"""Features the config accepts but shardwise does not implement yet, and blocks DeepSpeed has removed.

``NOT_IMPLEMENTED`` is the single list: key path -> predicate "is it switched on in this config?".
When a feature lands, delete its line. ``REMOVED`` lists what DeepSpeed itself refuses as removed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable


from .errors import ConfigError, describe_value
from .expert_parallel import NOT_IMPLEMENTED_KEYS as EXPERT_PARALLEL_NOT_IMPLEMENTED
from .tensor_parallel import AUTOTP_PRESETS

if TYPE_CHECKING:  # pragma: no cover
    from .model import ShardwiseConfig

__all__ = ["NOT_IMPLEMENTED", "REMOVED", "unsupported_features", "removed_features", "check_supported"]

# optimizer types (compared case-insensitively) that are not implemented yet
UNIMPLEMENTED_OPTIMIZERS: set[str] = set()


HINTS: dict[str, str] = {
    "hybrid_engine.inference_tp_size": " (the hybrid engine generates with whole, gathered weights: set it to 1)",
}


def _data_efficiency_on(path: str) -> Callable[["ShardwiseConfig"], bool]:
    def is_on(c: "ShardwiseConfig") -> bool:
        from shardwise.data.efficiency import unimplemented_data_efficiency

        return path in unimplemented_data_efficiency(c.data_efficiency)
    return is_on


def _switched_on(block: dict[str, Any]) -> bool:
    """A free-form block counts as on when ``enabled`` is true, or, lacking ``enabled``, when it is non-empty."""
    return bool(block.get("enabled")) if "enabled" in block else bool(block)


NOT_IMPLEMENTED: dict[str, Callable[["ShardwiseConfig"], bool]] = {
    "amp.enabled": lambda c: c.amp.enabled,
    "activation_checkpointing.contiguous_memory_optimization":
        lambda c: c.activation_checkpointing.contiguous_memory_optimization,
    "checkpoint.use_node_local_storage": lambda c: c.checkpoint.use_node_local_storage,
    "checkpoint.writer.type": lambda c: c.checkpoint.writer is not None and c.checkpoint.writer.type == "mock",
    "checkpoint.writer.data_parallel": lambda c: c.checkpoint.writer is not None
    and c.checkpoint.writer.data_parallel is not None,
    "checkpoint.writer.io_buffer_size": lambda c: c.checkpoint.writer is not None
    and c.checkpoint.writer.io_buffer_size != 64 * 1024**2,
    "checkpoint.writer.io_multiplier": lambda c: c.checkpoint.writer is not None and c.checkpoint.writer.io_multiplier != 1,
    "comet": lambda c: c.comet.enabled,
    "tensor_parallel.tp_overlap_comm": lambda c: c.tensor_parallel.tp_overlap_comm,
    "tensor_parallel.vocab_parallel_lm_head": lambda c: c.tensor_parallel.vocab_parallel_lm_head is True,
    "tensor_parallel.vocab_parallel_ce_backend": lambda c: c.tensor_parallel.vocab_parallel_ce_backend != "torch",
    "tensor_parallel.injection_policy_tuple": lambda c: c.tensor_parallel.injection_policy_tuple is not None,
    "tensor_parallel.partition_config": lambda c: c.tensor_parallel.partition_config is not None,
    "tensor_parallel.preset_model": lambda c: c.tensor_parallel.preset_model is not None
    and c.tensor_parallel.preset_model.lower() not in AUTOTP_PRESETS,
    "tensor_parallel.replace_with_kernel_inject": lambda c: c.tensor_parallel.replace_with_kernel_inject,
    **{f"expert_parallel.{key}": (lambda c, f=set_: c.expert_parallel.enabled and f(c.expert_parallel))
       for key, set_ in EXPERT_PARALLEL_NOT_IMPLEMENTED.items()},
    "hybrid_engine.inference_tp_size": lambda c: c.hybrid_engine.enabled and c.hybrid_engine.inference_tp_size > 1,
    # data_efficiency's random_ltd and curriculum_learning are implemented (shardwise.runtime.data_efficiency)
    **{path: _data_efficiency_on(path) for path in (
        "data_efficiency.data_sampling.dynamic_batching",
        "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule")},
    "compression_training": lambda c: _switched_on(c.compression_training),
    "nebula": lambda c: _switched_on(c.nebula),
}


_REMOVED_ISSUE = "https://github.com/deepspeedai/DeepSpeed/issues/8489"

# Blocks DeepSpeed 0.19.8 itself refuses as removed: key -> (is it switched on?, what to do instead).
REMOVED: dict[str, tuple[Callable[["ShardwiseConfig"], bool], str]] = {
    "sparse_gradients": (lambda c: c.sparse_gradients,
                         "delete the flag; embedding gradients are reduced dense"),
    "eigenvalue": (lambda c: _switched_on(c.eigenvalue),
                   "it only served Mixture-of-Quantization, which was removed too; delete the block"),
    "progressive_layer_drop": (lambda c: _switched_on(c.progressive_layer_drop),
                               "nothing replaces it; delete the block"),
    "curriculum_learning": (lambda c: _switched_on(c.curriculum_learning),
                            "DeepSpeed's replacement is data_efficiency.data_sampling.curriculum_learning; scripts "
                            "that truncate batches themselves build DeepSpeed's CurriculumScheduler "
                            "(shardwise.data.curriculum.CurriculumSchedule) from the block"),
}


def removed_features(cfg: "ShardwiseConfig") -> list[str]:
    """One message per switched-on block that DeepSpeed has removed, naming what replaces it."""
    return [f"{key}: removed from DeepSpeed (refused since 0.19.8, {_REMOVED_ISSUE}); {instead}"
            for key, (is_on, instead) in REMOVED.items() if is_on(cfg)]


def _shown(cfg: "ShardwiseConfig", path: str) -> str:
    value: Any = cfg
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else getattr(value, part)
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        return f" (= {describe_value(value)})"
    return ""


def unsupported_features(cfg: "ShardwiseConfig") -> list[str]:
    """Key paths of every switched-on feature that is not implemented yet, in table order."""
    return [path for path, is_on in NOT_IMPLEMENTED.items() if is_on(cfg)]


def check_supported(cfg: "ShardwiseConfig") -> None:
    problems = removed_features(cfg)
    problems += [f"not implemented yet: {p}{_shown(cfg, p)}{HINTS.get(p, '')}" for p in unsupported_features(cfg)]
    if problems:
        raise ConfigError(problems)
