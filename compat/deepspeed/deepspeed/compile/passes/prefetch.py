"""DeepCompile's all-gather prefetch pass (``deepspeed.compile.passes.prefetch``): its name, contract
and tuning constants, and the pass entry point. The pass leaves a graph alone when its profile is
incomplete (as DeepSpeed's does); the rewrite itself -- fusing all-gathers into DeepSpeed's compiled
``dc.prefetch_params_fused`` op, timed by its communication profiler -- has no shardwise counterpart."""
from __future__ import annotations

from typing import List, Tuple

import torch  # noqa: F401
from torch.fx import GraphModule, Node

import deepspeed.comm as dist
from deepspeed._surface import NotSupportedByShardwise, reason_for
from deepspeed.accelerator import get_accelerator  # noqa: F401 -- part of DeepSpeed's module namespace

from ..profilers.graph_profile import is_profile_incomplete
from .contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "prefetch"
# moves the all-gathers zero3_compile inserted
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))

FUSE_FACTOR = 0.8
MARGIN = 0.1
MAX_FUSE_SIZE = 1e9
MAX_BUFFERED_SIZE = 4e9

run_prefetch_pass = False


def print_rank_0(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message)


def get_ds_id(node: Node):
    """The ZeRO-3 parameter id an all-gather node gathers."""
    assert node.target == torch.ops.dc.allgather_param.default, f"{node.name} is not an allgather_param node"
    return node.args[2]


def schedule_prefetch(gm: GraphModule, graph_id: int, graph_order: List[Tuple[int, bool]], profiling_results,
                      create_inputs_fn, mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    """Reorder graph ``graph_id``'s all-gathers to prefetch parameters within the memory budget. A graph
    (forward, or backward when ``bwd``) whose profile is incomplete is returned unchanged, with a log
    line saying so."""
    profile = profiling_results[graph_id]
    graph = profile.bwd_graph if bwd else profile.fwd_graph
    complete = profile.bwd_mem_complete if bwd else profile.fwd_mem_complete
    if is_profile_incomplete(graph) or not complete:
        print_rank_0(f"schedule_prefetch graph_id={graph_id} incomplete profiling data; skipping prefetch")
        return gm
    raise NotSupportedByShardwise("deepspeed.compile.passes.prefetch.schedule_prefetch",
                                  reason_for("deepspeed.compile") + " (the prefetch rewrite emits DeepSpeed's "
                                  "compiled dc.prefetch_params_fused op)")
