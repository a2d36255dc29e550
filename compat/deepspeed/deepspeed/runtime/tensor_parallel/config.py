"""``deepspeed.runtime.tensor_parallel.config``: ``_get_hf_tp_plan(model)``, the merged Hugging Face tp_plan."""
from shardwise.tensor_parallel.autotp import hf_tp_plan as _get_hf_tp_plan

__all__ = ["_get_hf_tp_plan"]
