"""``deepspeed.runtime.utils``: shardwise.runtime.utils (``see_memory_usage``, ``set_random_seed``,
``move_to_device``), the layer-partitioning helpers of shardwise's pipeline, ``PartitionedTensor``
(shardwise.utils.partitioned_tensor) and DeepSpeed's small formatting helper."""

import math

import torch

from shardwise.pipe.partition import partition_uniform  # noqa: F401
from shardwise.runtime.utils import *  # noqa: F401,F403
from shardwise.runtime.utils import move_to_device, prefix_sum_inc, see_memory_usage, set_random_seed  # noqa: F401
from shardwise.runtime.utils import partition_min_spread as partition_balanced  # noqa: F401
from shardwise.tensor_parallel.layers import is_tensor_parallel
from shardwise.utils.partitioned_tensor import PartitionedTensor  # noqa: F401


def is_model_parallel_parameter(p) -> bool:
    """True for a tensor-sharded parameter (``tensor_model_parallel``, or Megatron's older ``model_parallel``)."""
    return bool(getattr(p, "model_parallel", False)) or is_tensor_parallel(p)


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


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None) -> torch.Tensor:
    """DeepSpeed's stand-alone clipping helper: ``shardwise.precision.clip_grad_norm_`` with the slices of
    ``mpu``'s model-parallel group adding up (replicated parameters counted on model rank 0 only) and the
    norm averaged over the data-parallel group, as DeepSpeed's helper does. The engine clips from the config
    itself (``gradient_clipping``)."""
    from shardwise import comm
    from deepspeed.utils import groups
    from shardwise.precision import clip_grad_norm_ as clip

    model_group = None if mpu is None else (mpu.get_model_parallel_group() or comm.get_world_group())
    average_group = None
    if comm.is_initialized():  # DeepSpeed's data-parallel group is the whole world when no grid was set up
        average_group = groups.get_data_parallel_group() or comm.get_world_group()
    return clip(parameters, max_norm, norm_type, model_group=model_group,
                count_replicated=mpu is None or mpu.get_model_parallel_rank() == 0, average_group=average_group)


def get_weight_norm(parameters, norm_type=2, mpu=None) -> float:
    """DeepSpeed's helper: the ``norm_type`` norm of the tensors' values taken as one vector
    (``shardwise.precision.total_norm``), combined over ``mpu``'s model-parallel group (replicated tensors
    counted on tensor rank 0 only, pipeline-replicated ones not at all); ``-1`` when it is inf or NaN."""
    from shardwise.precision import total_norm

    tensors = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if float(norm_type) != float("inf"):
        tp_rank = mpu.get_model_parallel_rank() if mpu is not None else 0
        tensors = [p for p in tensors if not getattr(p, "ds_pipe_replicated", False)
                   and (tp_rank == 0 or is_model_parallel_parameter(p))]
    group = mpu.get_model_parallel_group() if mpu is not None else None
    value = float(total_norm([t.data for t in tensors], norm_type, model_group=group))
    return value if math.isfinite(value) else -1


class CheckOverflow:
    """Whether any gradient of the given parameter groups holds an inf or NaN, agreed over the ranks that
    hold different pieces: the largest expert-parallel group when there are expert (MoE) parameters, the
    model-parallel group of ``mpu``, or the world with ``zero_reduce_scatter``."""

    def __init__(self, param_groups=None, mpu=None, zero_reduce_scatter=False, deepspeed=None) -> None:
        from shardwise.moe.utils import is_moe_param

        self.mpu, self.zero_reduce_scatter, self.deepspeed = mpu, zero_reduce_scatter, deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(is_moe_param(p) for p in self.params or ())

    def _agree(self, flag: bool, *, moe: bool, world: bool) -> bool:
        from shardwise import comm
        from deepspeed.utils import groups

        t = torch.tensor([float(flag)])
        if moe:
            comm.all_reduce(t, op=comm.ReduceOp.MAX, group=groups._get_max_expert_parallel_group())
        if world:
            comm.all_reduce(t, op=comm.ReduceOp.MAX)
        elif self.mpu is not None:
            comm.all_reduce(t, op=comm.ReduceOp.MAX, group=self.mpu.get_model_parallel_group())
        return bool(t.item())

    def check_using_norm(self, norm_group, reduce_overflow=True) -> bool:
        bad = any(not torch.isfinite(torch.as_tensor(n)).all() or bool((torch.as_tensor(n) < 0).any())
                  for n in norm_group)
        return self._agree(bad, moe=self.has_moe_params, world=self.mpu is None and reduce_overflow)

    def check(self, param_groups=None) -> bool:
        if param_groups is None:
            return self.has_overflow(self.params, has_moe_params=self.has_moe_params)
        from shardwise.moe.utils import is_moe_param

        params = [p for group in param_groups for p in group]
        return self.has_overflow(params, has_moe_params=any(is_moe_param(p) for p in params))

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and not torch.isfinite(p.grad).all() for p in params)

    def has_overflow(self, params, has_moe_params=None) -> bool:
        moe = self.has_moe_params if has_moe_params is None else has_moe_params
        return self._agree(self.has_overflow_serial(params), moe=moe, world=self.zero_reduce_scatter)


class OutputBackwardHookManager:
    """Runs ``preprocess_once_fn()`` once when a backward pass first reaches any of a forward's outputs, and
    ``preprocess_per_tensor_fn(grad)`` (its result replaces the gradient) at each of them (DeepSpeed's class).

    ``register_hooks_on_outputs`` hooks every tensor with a ``grad_fn`` in a tensor, or a tuple / list / dict
    nesting of them; ``hook_handles`` lists the hooks (empty when no output takes part in autograd). The
    manager is kept alive by the first hooked output (``_backward_hook_managers``), so it lives as long as
    the outputs do."""

    def __init__(self, preprocess_once_fn, preprocess_per_tensor_fn=None) -> None:
        self.preprocess_once_fn = preprocess_once_fn
        self.preprocess_per_tensor_fn = preprocess_per_tensor_fn
        self.preprocess_done = False
        self.hook_handles = []

    def _make_backward_hook(self, tensor):
        def hook(grad):
            if not self.preprocess_done:
                self.preprocess_done = True
                self.preprocess_once_fn()
            return grad if self.preprocess_per_tensor_fn is None else self.preprocess_per_tensor_fn(grad)

        return hook

    def _outputs_with_grad_fn(self, outputs):
        if isinstance(outputs, torch.Tensor):
            if outputs.grad_fn is not None:
                yield outputs
        elif isinstance(outputs, (tuple, list)):
            for item in outputs:
                yield from self._outputs_with_grad_fn(item)
        elif isinstance(outputs, dict):
            for item in outputs.values():
                yield from self._outputs_with_grad_fn(item)

    def register_hooks_on_outputs(self, outputs) -> None:
        """Hook ``outputs`` (replacing hooks an earlier call made) for the next backward."""
        self.remove_hooks()
        self.preprocess_done = False
        hooked = list(self._outputs_with_grad_fn(outputs))
        self.hook_handles.extend(t.register_hook(self._make_backward_hook(t)) for t in hooked)
        if hooked:
            keeper = hooked[0]
            if not hasattr(keeper, "_backward_hook_managers"):
                keeper._backward_hook_managers = []
            keeper._backward_hook_managers.append(self)

    def remove_hooks(self) -> None:
        for handle in self.hook_handles:
            handle.remove()
        self.hook_handles.clear()

    def reset(self) -> None:
        """Let ``preprocess_once_fn`` run again at the next backward, keeping the hooks."""
        self.preprocess_done = False


def register_output_backward_hooks(outputs, preprocess_once_fn, preprocess_per_tensor_fn=None):
    """Hook a forward's ``outputs`` so that ``preprocess_once_fn()`` runs once when the backward reaches them
    (and ``preprocess_per_tensor_fn`` on each output's gradient); returns the ``OutputBackwardHookManager``."""
    manager = OutputBackwardHookManager(preprocess_once_fn, preprocess_per_tensor_fn)
    manager.register_hooks_on_outputs(outputs)
    return manager


__all__ = ["CheckOverflow", "clip_grad_norm_", "get_weight_norm", "call_to_str", "count_used_parameters_in_backward", "is_model_parallel_parameter", "move_to_device", "PartitionedTensor", "prefix_sum_inc", "partition_balanced", "partition_uniform", "see_memory_usage", "set_random_seed", "OutputBackwardHookManager", "register_output_backward_hooks"]
