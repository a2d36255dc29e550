"""DeepCompile's graph helpers over ``torch.fx`` graphs (inputs, casts, last uses, aliasing ops), its
backward-hook lists and logging. ``get_deepcompile_handle`` -- DeepSpeed's compiled ``dc`` extension --
has no shardwise counterpart and raises."""
from __future__ import annotations

import operator
from collections import defaultdict
from functools import reduce
from typing import Dict, List, Optional, Tuple

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

import deepspeed.comm as dist
from deepspeed._surface import NotSupportedByShardwise, reason_for
from deepspeed.accelerator import get_accelerator
from deepspeed.utils.torch import required_torch_version

dc_handle = None

backward_started = False
pre_backward_hooks = []
post_backward_hooks = []


def is_deepcompile_supported() -> bool:
    """DeepCompile runs on torch >= 2.6 with CUDA in DeepSpeed; shardwise has no DeepCompile runtime: False."""
    return False


def get_deepcompile_handle():
    """DeepSpeed's compiled DeepCompile extension: not available in shardwise."""
    raise NotSupportedByShardwise("deepspeed.compile.util.get_deepcompile_handle", reason_for("deepspeed.compile"))


def is_backend_inductor(backend):
    return backend == "inductor"


def add_pre_backward_hook(hook):
    pre_backward_hooks.append(hook)


def add_post_backward_hook(hook):
    post_backward_hooks.append(hook)


def deepcompile_backward_epilogue():
    for hook in post_backward_hooks:
        hook()


def log_rank0(msg: str, enable: bool = False):
    """Print ``msg`` on rank 0 (or without a process group) when ``enable``."""
    if enable and (not dist.is_initialized() or dist.get_rank() == 0):
        print(msg)


_no_copy_ops = None


def get_no_copy_ops():
    """The ops whose output may alias an input: every ``aten`` overload whose schema marks a returned
    tensor as an alias (an overload without a schema counts too), plus DeepCompile's
    ``dc.wait_allgather`` once that op is defined."""
    global _no_copy_ops
    if _no_copy_ops is None:
        found = set()
        for op_name in torch.ops.aten:
            packet = getattr(torch.ops.aten, op_name)
            for overload in packet:
                op = getattr(packet, overload)
                schema = getattr(op, "_schema", None)
                if schema is None or any(isinstance(r.type, torch.TensorType) and r.alias_info is not None
                                         for r in schema.returns):
                    found.add(op)
        _no_copy_ops = found
    ops = set(_no_copy_ops)
    try:
        ops.add(torch.ops.dc.wait_allgather.default)
    except (AttributeError, RuntimeError):
        pass
    return ops


def get_input_nodes(graph: Graph) -> List[Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


def get_param_nodes(graph: Graph, index_to_ds_ids: List[Tuple[int, int]]) -> List[Node]:
    inputs = get_input_nodes(graph)
    return [inputs[entry[0]] for entry in index_to_ds_ids]


def is_comm_op(node: Node) -> bool:
    return bool(node.meta.get("comm", False))


def is_cast_op(node: Node) -> Tuple[bool, Optional[torch.dtype]]:
    """``(True, dtype)`` for a dtype conversion node (``prims.convert_element_type`` or an
    ``aten._to_copy`` given only ``dtype``), else ``(False, None)``."""
    if node.op == "call_function":
        if node.target == torch.ops.prims.convert_element_type.default:
            return True, node.args[1]
        if node.target == torch.ops.aten._to_copy.default and set(node.kwargs) == {"dtype"}:
            return True, node.kwargs["dtype"]
    return False, None


_ELEM_SIZE = {torch.float32: 4, torch.float64: 8, torch.int64: 8, torch.float16: 2, torch.bfloat16: 2, torch.bool: 1}


def dtype_to_elem_size(dtype: torch.dtype) -> int:
    if dtype not in (torch.float32, torch.float64, torch.float16):
        raise ValueError(f"Unsupported dtype: {dtype}")
    return _ELEM_SIZE[dtype]


def tensor_meta_size(tensor_meta) -> int:
    if tensor_meta.dtype not in _ELEM_SIZE:
        raise ValueError(f"Unsupported dtype: {tensor_meta.dtype}")
    numel = reduce(operator.mul, tensor_meta.shape, 1)
    return numel * _ELEM_SIZE[tensor_meta.dtype]


def get_last_uses(graph: Graph):
    """``(node_to_last_use, user_to_last_uses)``: the node after which each value is dead, and the
    values that die at each node. A use through an aliasing op (:func:`get_no_copy_ops`) keeps the value
    alive as long as the alias: the alias's own last use counts, and an alias nobody uses is itself the
    last use."""
    position = {node: i for i, node in enumerate(graph.nodes)}
    no_copy_ops = get_no_copy_ops()
    node_to_last_use: Dict[Node, Node] = {}
    user_to_last_uses: Dict[Node, List[Node]] = {}

    def visit(value: Node, user: Node):
        effective = node_to_last_use.get(user, user) if user.target in no_copy_ops else user
        current = node_to_last_use.get(value)
        if current is not None:
            # walking backwards, the first user seen is the latest, unless an alias outlives it
            if user.target not in no_copy_ops or position[effective] <= position[current]:
                return
            user_to_last_uses[current].remove(value)
        node_to_last_use[value] = effective
        user_to_last_uses.setdefault(effective, []).append(value)

    for node in reversed(graph.nodes):
        map_arg(node.args, lambda n: visit(n, node))
        map_arg(node.kwargs, lambda n: visit(n, node))
    return node_to_last_use, user_to_last_uses


def get_real_uses(graph: Graph):
    """Node -> the nodes that use its value, looking through aliasing ops to their users (the graph
    output is not a use)."""
    uses: Dict[Node, List[Node]] = defaultdict(list)
    no_copy_ops = get_no_copy_ops()

    def visit(value: Node, user: Node):
        if user.target == "output":
            return
        if user.target in no_copy_ops:
            uses[value].extend(uses[user])
        else:
            uses[value].append(user)

    for node in reversed(graph.nodes):
        map_arg(node.args, lambda n: visit(n, node))
        map_arg(node.kwargs, lambda n: visit(n, node))
    return uses


def get_index_by_graph_id(graph_order, target_graph_id):
    """Position of ``target_graph_id`` in ``graph_order`` (``[(graph_id, needs_backward), ...]``), -1 if absent."""
    for index, (graph_id, _) in enumerate(graph_order):
        if graph_id == target_graph_id:
            return index
    return -1


def get_activation_node_names(graph: Graph, param_nodes_bw: List[Node], fwd_output_names: List[str]):
    """Inputs of a backward graph that are forward outputs and not parameters: the saved activations."""
    params = {n.name for n in param_nodes_bw}
    return [n.name for n in get_input_nodes(graph) if n.name in fwd_output_names and n.name not in params]


def is_release_node(n: Node) -> bool:
    return n.target == torch.ops.dc.release_param.default
