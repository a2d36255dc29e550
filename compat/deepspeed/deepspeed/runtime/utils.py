"""``deepspeed.runtime.utils``: shardwise.runtime.utils (``see_memory_usage``, ``set_random_seed``), the
layer-partitioning helpers of shardwise's pipeline, and DeepSpeed's small formatting helper."""
from shardwise.pipe.partition import partition_balanced, partition_uniform  # noqa: F401
from shardwise.runtime.utils import *  # noqa: F401,F403
from shardwise.runtime.utils import see_memory_usage, set_random_seed  # noqa: F401

import torch


def call_to_str(base: str, *args, **kwargs) -> str:
    """``call_to_str("f", 1, x="a")`` -> ``"f(1, x='a')"``: a call written out, for logs."""
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{base}({', '.join(shown)})"


def count_used_parameters_in_backward(parameters) -> int:
    """How many of ``parameters`` the backward pass now running will reach (call it from a backward hook).
    Parameters that need no gradient or are not in the graph are not counted; parameters sharing one
    gradient node count once."""
    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError("count_used_parameters_in_backward: call it during a backward pass (from a hook)")
    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    nodes = set()
    with torch.enable_grad():  # hooks run without grad mode; finding a leaf's accumulator needs it
        for p in parameters:
            if isinstance(p, torch.Tensor) and p.requires_grad:
                node = _get_grad_fn_or_grad_acc(p)
                if node is not None:
                    nodes.add(node)
    return sum(1 for node in nodes if torch._C._will_engine_execute_node(node))


__all__ = ["call_to_str", "count_used_parameters_in_backward", "partition_balanced", "partition_uniform", "see_memory_usage", "set_random_seed"]
