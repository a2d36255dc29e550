"""DeepCompile's joint-graph partitioner wrapper (``deepspeed.compile.partitioner``): under ZeRO-3 the
nodes that alias or down-cast a parameter are marked for recomputation, so the forward does not keep
gathered parameters alive for the backward; the wrapped partitioner also records, per dynamo frame,
that it was partitioned and how many forward outputs the caller receives."""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Tuple

import torch
from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy

try:
    from torch._functorch.partitioners import _is_primal
except ImportError:  # older torch
    def _is_primal(node):
        return node.op == "placeholder" and "tangents" not in str(node.target)

from .util import get_no_copy_ops, is_cast_op


def _recompute_param_aliases(joint_graph: Graph, param_indices: List[Tuple[int, int, torch.Size]]):
    """Mark ``MUST_RECOMPUTE`` every node that aliases (a :func:`get_no_copy_ops` op) or casts a ZeRO-3
    parameter input (``param_indices``: ``(primal index, ds_id, shape)``) or such a node; other nodes
    keep their policy. Nodes without an ``ac_graph_id`` get 1 (what the min-cut partitioner expects of
    a graph without checkpointed regions)."""
    no_copy_ops = get_no_copy_ops()
    primals = [n for n in joint_graph.nodes if _is_primal(n)]
    marked = {primals[index] for index, _, _ in param_indices}
    params_and_aliases = set(marked)

    for node in joint_graph.nodes:
        node.meta.setdefault("ac_graph_id", 1)
        if node.op != "call_function":
            continue
        if not (node.target in no_copy_ops or is_cast_op(node)[0]):
            continue
        if any(isinstance(a, Node) and a in params_and_aliases for a in node.args):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            params_and_aliases.add(node)


# dynamo frame -> how many forward outputs the caller receives (the rest are saved for backward)
_num_fwd_outputs_by_frame: Dict[int, int] = {}


def get_num_fwd_outputs(frame_id: int) -> Optional[int]:
    return _num_fwd_outputs_by_frame.get(frame_id)


def get_wrapped_partitioner(z3_partition: bool, param_indices: List[Tuple[int, int, torch.Size]], partition_fn,
                            frame_id: int, frames_partitioned: Set[int]):
    """``partition_fn`` that first records ``frame_id`` as partitioned (and its forward output count)
    and, under ZeRO-3 (``z3_partition``), marks the parameter aliases for recomputation."""

    def partition_recompute_ds_params(joint_module: GraphModule, _joint_inputs, *, num_fwd_outputs,
                                      **kwargs) -> Tuple[GraphModule, GraphModule]:
        frames_partitioned.add(frame_id)
        _num_fwd_outputs_by_frame[frame_id] = num_fwd_outputs
        if z3_partition:
            _recompute_param_aliases(joint_module.graph, param_indices)
        return partition_fn(joint_module, _joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    return partition_recompute_ds_params
