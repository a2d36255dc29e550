"""``deepspeed.runtime.utils``: shardwise.runtime.utils (``see_memory_usage``, ``set_random_seed``), the
layer-partitioning helpers of shardwise's pipeline, and DeepSpeed's small formatting helper."""
from shardwise.pipe.partition import partition_balanced, partition_uniform  # noqa: F401
from shardwise.runtime.utils import *  # noqa: F401,F403
from shardwise.runtime.utils import see_memory_usage, set_random_seed  # noqa: F401
from shardwise.tensor_parallel.layers import is_tensor_parallel


def is_model_parallel_parameter(p) -> bool:
    """True for a tensor-sharded parameter (``tensor_model_parallel``, or Megatron's older ``model_parallel``)."""
    return bool(getattr(p, "model_parallel", False)) or is_tensor_parallel(p)


def call_to_str(base: str, *args, **kwargs) -> str:
    """``call_to_str("f", 1, x="a")`` -> ``"f(1, x='a')"``: a call written out, for logs."""
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(shown)})"


__all__ = ["call_to_str", "is_model_parallel_parameter", "partition_balanced", "partition_uniform", "see_memory_usage", "set_random_seed"]
