"""DeepSpeed's ``data_efficiency`` config block, read as DeepSpeed reads it, and what shardwise does with it.

    "data_efficiency": {
      "enabled": true, "seed": 1234,
      "data_routing": {"random_ltd": {"enabled": true, "total_layer_num": 24, "random_ltd_layer_num": 22,
                                      "random_ltd_layer_id": [1, 2, ...], "model_mask_name": "attention_mask",
                                      "model_type": "encoder", "hidden_state_order": "batch_seq_dim",
                                      "random_ltd_schedule": {...}}},
      "data_sampling": {"curriculum_learning": {...}, "dynamic_batching": {...}}
    }

The engine honours (``shardwise.runtime.data_efficiency``) ``data_routing.random_ltd`` (layers wrapped with
``TokenDropLayer``, DeepSpeed's ``convert_to_random_ltd``, keep the scheduled number of tokens) and
``data_sampling.curriculum_learning`` (its training loader draws batches by difficulty:
``shardwise.data.curriculum_sampler``). ``data_sampling.dynamic_batching`` is not implemented and refused
by name.

As in DeepSpeed, a sub-feature is on when its own ``enabled`` is true, whatever the outer blocks say.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["data_efficiency_settings", "unimplemented_data_efficiency", "RANDOM_LTD_NEEDS"]

RANDOM_LTD_NEEDS = ("total_layer_num", "random_ltd_layer_num", "random_ltd_layer_id", "model_mask_name",
                    "model_type", "hidden_state_order", "random_ltd_schedule")


def _on(block: Any) -> bool:
    return isinstance(block, dict) and bool(block.get("enabled", False))


def data_efficiency_settings(block: dict[str, Any] | None) -> dict[str, Any]:
    """The block with DeepSpeed's defaults filled in (``get_data_efficiency_config``'s result)."""
    block = block or {}
    sampling = dict(block.get("data_sampling", {}))
    routing = block.get("data_routing", {})
    ltd_in = routing.get("random_ltd", {})
    ltd: dict[str, Any] = {"enabled": False, "layer_token_lr_schedule": {"enabled": False}}
    if _on(ltd_in):
        ltd.update({k: copy.copy(v) for k, v in ltd_in.items()})
        ltd.setdefault("layer_token_lr_schedule", {"enabled": False})
    curriculum = dict(sampling.get("curriculum_learning", {}))
    curriculum["enabled"] = bool(curriculum.get("enabled", False))
    dynamic = dict(sampling.get("dynamic_batching", {}))
    dynamic["enabled"] = bool(dynamic.get("enabled", False))
    sampling.update(enabled=bool(sampling.get("enabled", False)), num_epochs=sampling.get("num_epochs", 1000),
                    num_workers=sampling.get("num_workers", 0), pin_memory=sampling.get("pin_memory", False),
                    curriculum_learning=curriculum, dynamic_batching=dynamic)
    return {"enabled": bool(block.get("enabled", False)), "seed": block.get("seed", 1234),
            "data_sampling": sampling,
            "data_routing": {"enabled": bool(routing.get("enabled", False)), "random_ltd": ltd}}


def unimplemented_data_efficiency(block: dict[str, Any] | None) -> list[str]:
    """Key paths of switched-on data-efficiency features shardwise does not implement, and of missing
    random-LTD keys (``data_efficiency.data_routing.random_ltd.<key>``)."""
    s = data_efficiency_settings(block)
    problems = []
    if s["data_sampling"]["dynamic_batching"]["enabled"]:
        problems.append("data_efficiency.data_sampling.dynamic_batching")
    ltd = s["data_routing"]["random_ltd"]
    if ltd["enabled"]:
        problems += [f"data_efficiency.data_routing.random_ltd.{key} (missing)" for key in RANDOM_LTD_NEEDS
                     if key not in ltd]
        if ltd["layer_token_lr_schedule"].get("enabled"):
            problems.append("data_efficiency.data_routing.random_ltd.layer_token_lr_schedule")
    return problems
