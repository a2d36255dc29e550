"""Reference models built from shardwise's parallel layers (used by tests, benchmarks and demos)."""

from shardwise.models.gpt import GPT, GPTConfig, gpt_layer_specs, gpt_loss, gpt_pipeline_module

__all__ = ["GPT", "GPTConfig", "gpt_layer_specs", "gpt_loss", "gpt_pipeline_module"]
