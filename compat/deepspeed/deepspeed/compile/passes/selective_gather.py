"""DeepCompile's selective-gather pass (``deepspeed.compile.passes.selective_gather``): after profiling,
on the last graph that needs a backward, it picks ZeRO-3 parameters to keep gathered ("persistent")
while the profiled memory leaves room: candidates in order of all-gather time per byte, highest first,
added while their total fits under ``total memory * (1 - MEM_MARGIN)`` minus the highest transient
peak any profiled graph reached. Nothing is chosen when any graph's profile is incomplete. The choice
is handed to the DeepCompile handle's ``set_persistent``."""
from __future__ import annotations

from collections import defaultdict
from typing import Dict, List, Tuple

import torch
from torch.fx import GraphModule

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.utils import log_dist

from ..profilers.graph_profile import is_profile_incomplete
from ..util import get_deepcompile_handle
from .contract import CAP_Z3_GATHER_RELEASE, PassContract

NAME = "selective_gather"
# picks which of zero3_compile's all-gathers stay resident
CONTRACT = PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))

max_alloc_mem = 0
last_optimize_step = 0
MEM_MARGIN = 0.1


def print_rank_0(message):
    log_dist(message, ranks=[0])


def _maybe_update_size_from_profile(ds_id_to_size: Dict[int, int], ds_id: int, tensor_size: int) -> None:
    """Prefer the profiled gathered size of ``ds_id`` when the profiler measured one."""
    if tensor_size > 0:
        ds_id_to_size[ds_id] = tensor_size


def _time_per_byte(ds_id_to_time: Dict[int, float], ds_id_to_size: Dict[int, int], ds_id: int) -> float:
    size = ds_id_to_size.get(ds_id, 0)
    return ds_id_to_time[ds_id] / size if size > 0 else 0.0


def _compute_persistence_budget(all_graph_mem_records: List[List[Tuple[str, int, int, int]]], total_mem: int,
                                mem_margin: float) -> Dict[str, int]:
    """The memory left for persistent parameters. ``all_graph_mem_records``: per profiled graph, records
    ``(name, current_alloc, delta, peak)``. Returns ``usable_mem`` (total less the margin), the highest
    resident allocation and transient peak over all records, ``available_mem`` (usable less the
    transient peak, never negative: persistent parameters stay resident through every transient peak)
    and how many non-empty record lists there were."""
    usable = int(total_mem * (1 - mem_margin))
    lists = [records for records in all_graph_mem_records if records]
    resident = max((r[1] for records in lists for r in records), default=0)
    transient = max((r[3] for records in lists for r in records), default=0)
    return {
        "usable_mem": usable,
        "peak_resident_alloc": resident,
        "transient_peak": transient,
        "available_mem": max(0, usable - transient) if lists else 0,
        "profiled_list_count": len(lists),
    }


def _profile_result_incomplete(prof) -> bool:
    return (is_profile_incomplete(prof.fwd_graph) or is_profile_incomplete(prof.bwd_graph)
            or not prof.fwd_mem_complete or (prof.needs_backward and not prof.bwd_mem_complete))


def _allgathers(graph):
    if graph is None:
        return []
    return [n for n in graph.nodes if n.target == torch.ops.dc.allgather_param.default]


def selective_gather(gm: GraphModule, graph_id: int, graph_order: List[Tuple[int, bool]], profiling_results,
                     create_inputs_fn, mem_budget: float, param_manager, bwd: bool) -> GraphModule:
    """Run on the backward of the first graph in ``graph_order`` that needs one (the last backward to
    run); mark parameters persistent as the module docstring describes. Returns ``gm`` unchanged."""
    if not bwd:
        return gm
    last_backward = next((g for g, needs_bwd in graph_order if needs_bwd), None)
    if last_backward is None or graph_id != last_backward:
        return gm

    incomplete = [g for g, prof in profiling_results.items() if _profile_result_incomplete(prof)]
    if incomplete:
        print_rank_0(f"selective_gather incomplete profiling data for graph_ids={incomplete}; "
                     "skipping persistence update")
        return gm

    mem_records = []
    for prof in profiling_results.values():
        mem_records += [prof.fwd_mem, prof.bwd_mem]

    already = {pm.ds_ids[name] for pm in param_manager.values() for name, p in pm.params.items()
               if p.param.ds_persist}
    size: Dict[int, int] = {}
    gather_time: Dict[int, float] = defaultdict(float)
    param_of = {}
    for g, pm in param_manager.items():
        for name, p in pm.params.items():
            size[pm.ds_ids[name]] = p.numel * p.dtype.itemsize
            param_of[pm.ds_ids[name]] = p.param
        prof = profiling_results[g]
        for n in _allgathers(prof.fwd_graph) + _allgathers(prof.bwd_graph):
            _maybe_update_size_from_profile(size, n.args[2], n.meta["tensor_size"])
            gather_time[n.args[2]] += n.meta["device_time"]

    candidates = sorted((d for d in size if d not in already), key=lambda d: _time_per_byte(gather_time, size, d),
                        reverse=True)

    accelerator = get_accelerator()
    totals = torch.tensor([accelerator.total_memory(), accelerator.available_memory()],
                          device=torch.device(accelerator.current_device()))
    dist.all_reduce(totals, dist.ReduceOp.MIN)
    total_mem = totals[0].item()

    budget = _compute_persistence_budget(mem_records, total_mem, MEM_MARGIN)
    print_rank_0(f"selective_gather graph_id={graph_id} total_mem={total_mem} usable_mem={budget['usable_mem']} "
                 f"peak_resident_alloc={budget['peak_resident_alloc']} transient_peak={budget['transient_peak']} "
                 f"available_mem={budget['available_mem']} persistent_count={len(already)} "
                 f"candidate_count={len(candidates)}")
    if budget["profiled_list_count"] == 0:
        print_rank_0("selective_gather no profiling data; skipping persistence update")
        return gm
    if not candidates:
        print_rank_0("selective_gather no candidates to persist")
        return gm
    if budget["available_mem"] == 0:
        print_rank_0("selective_gather no profiled headroom for new persistent params")
        return gm

    handle = get_deepcompile_handle()
    used = 0
    chosen = 0
    for ds_id in candidates:
        if used + size[ds_id] > budget["available_mem"]:
            break
        used += size[ds_id]
        chosen += 1
        handle.set_persistent(ds_id)
        print_rank_0(f"Set persistent: {ds_id} size: {size[ds_id]} persistent_mem: {used} "
                     f"shape: {param_of[ds_id].ds_shape}")
    if chosen:
        print_rank_0(f"selective_gather selected_count={chosen} selected_bytes={used}")
    else:
        print_rank_0(f"selective_gather selected no new params: available_mem={budget['available_mem']} "
                     f"smallest_candidate={min(size[d] for d in candidates)}")
    return gm
