"""DeepCompile's backend bookkeeping (``deepspeed.compile.backend``): the pass schedule and its steps,
the registry of compile passes, the per-frame compiled-backward state and the helpers that pick a
graph's real inputs and agree across ranks on a memory profile. ``make_backend`` -- the torch.compile
backend that runs the passes with DeepSpeed's compiled ``dc`` ops -- is not provided by shardwise."""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Dict, List, Set, Tuple

import torch
from torch.fx import Graph

import deepspeed.comm as dist
from deepspeed.accelerator import get_accelerator

from .input_storage import InputStorage
from .patch_compiled_func import (clear_backward_inputs, patch_compiled_func, pop_backward_input,  # noqa: F401
                                  register_backward_frame, unpatch_compiled_func)
from .profilers import ProfilingResult
from .util import get_deepcompile_handle, log_rank0

remaining_schedule = None
next_pass_step = -1
next_passes = None
current_passes = None

param_manager: Dict[int, object] = {}


class GraphOrder:
    """The graphs compiled so far, in first-seen order, one per dynamo frame: ``frame_id ->
    (graph_id, needs_backward)`` (``needs_backward`` None until known)."""

    def __init__(self):
        self.frames = OrderedDict()

    def __len__(self):
        return len(self.frames)

    def add_graph(self, graph_id: int, frame_id: int):
        self.frames.setdefault(frame_id, (graph_id, None))

    def set_needs_backward(self, frame_id: int, needs_backward: bool):
        if frame_id in self.frames:
            self.frames[frame_id] = (self.frames[frame_id][0], needs_backward)

    def get_graph_order(self) -> List[Tuple[int, bool]]:
        """``[(graph_id, needs_backward), ...]``; every graph's ``needs_backward`` must be known."""
        order = list(self.frames.values())
        assert all(isinstance(nb, bool) for _, nb in order), "a graph's needs_backward is not known yet"
        return order

    def clear(self):
        self.frames.clear()


graph_order_with_frame_id = GraphOrder()

frames_needing_bwd = set()  # frame keys whose compiled backward inputs are being captured
frames_partitioned: Set[int] = set()
profiling_results: Dict[int, ProfilingResult] = {}
opt_pass_times = []
opt_passes = {}  # pass name -> pass callable

fwd_real_inputs = []


def cleanup_compiled_backward_state(frame_id=None, owned_frames=None):
    """Release compiled-backward capture state: of one frame (``frame_id``, also dropped from
    ``owned_frames``), of the frames in ``owned_frames`` (which is emptied), or of every frame. The
    ``torch.autograd.Function`` patch is removed once no frame needs it."""
    if frame_id is not None:
        released = {frame_id}
        if owned_frames is not None:
            owned_frames.discard(frame_id)
    elif owned_frames is not None:
        released = set(owned_frames)
        owned_frames.clear()
    else:
        released = set(frames_needing_bwd)
    frames_needing_bwd.difference_update(released)
    clear_backward_inputs(released)
    if not frames_needing_bwd:
        unpatch_compiled_func()


def register_compile_pass(name: str, opt_pass_fn, contract=None):
    """Register the pass ``opt_pass_fn`` under ``name`` together with its contract (``None`` clears a
    contract ``name`` had)."""
    from .passes.contract import register_pass_contract

    opt_passes[name] = opt_pass_fn
    register_pass_contract(name, contract)


def init_schedule(schedule):
    """Set the pass schedule, ``[(step, [pass, ...]), ...]``, that :func:`launch_compile_passes` walks."""
    assert isinstance(schedule, list), f"schedule should be a list, but got {type(schedule)}"
    for step, passes in schedule:
        assert isinstance(step, int), f"Each step in schedule should be an integer, but got {type(step)}"
        assert isinstance(passes, list), f"Passes at a certain step should be a list, but got {type(passes)}"
    global remaining_schedule
    remaining_schedule = deque(schedule)


def launch_compile_passes(global_steps: int, owned_frames=None):
    """At the schedule's next step: take its passes, reset dynamo and the DeepCompile handle, and drop
    the previous compile cycle's graphs, profiles and the compiled-backward state of ``owned_frames``."""
    global next_passes
    if not remaining_schedule or remaining_schedule[0][0] != global_steps:
        return
    _, next_passes = remaining_schedule.popleft()
    log_rank0(f"Launching compile passes: global_steps={global_steps} passes={next_passes}", True)
    torch._dynamo.reset()
    get_deepcompile_handle().reset()
    graph_order_with_frame_id.clear()
    profiling_results.clear()
    param_manager.clear()
    cleanup_compiled_backward_state(owned_frames=owned_frames)
    frames_partitioned.clear()


def set_time_and_tensor_size(graph_id, graph: Graph, mem, bwd, profiling_results, mem_complete=True):
    """Record ``graph``'s per-node times and tensor sizes (0 where a node has none) and the memory
    records in ``profiling_results[graph_id]``, for the backward graph when ``bwd``."""
    times = [(n.name, n.meta.get("device_time", 0.0), n.meta.get("wall_time", 0.0)) for n in graph.nodes]
    sizes = [(n.name, n.meta.get("tensor_size", 0)) for n in graph.nodes]
    result = profiling_results[graph_id]
    side = "bwd" if bwd else "fwd"
    setattr(result, f"{side}_graph", graph)
    setattr(result, f"{side}_time", times)
    setattr(result, f"{side}_tensor_sizes", sizes)
    setattr(result, f"{side}_mem", mem)
    setattr(result, f"{side}_mem_complete", mem_complete)


def _sync_memory_profile_complete(profile_complete: bool) -> bool:
    """Whether the memory profile is complete on every rank (a MIN all-reduce; the local answer
    without a process group)."""
    if not dist.is_initialized():
        return profile_complete
    flag = torch.tensor([1 if profile_complete else 0], device=torch.device(get_accelerator().current_device()))
    dist.all_reduce(flag, dist.ReduceOp.MIN)
    return bool(flag.item())


def _get_fw_real_inputs(local_real_inputs, input_storage: InputStorage, graph_id: int, debug_log: bool = False):
    """The real inputs for compiling graph ``graph_id``'s forward: the next entry of the graph's own
    one-shot queue, else inputs rebuilt from ``input_storage``; ``RuntimeError`` when neither has any."""
    if local_real_inputs:
        return local_real_inputs.popleft()
    if input_storage.has_data():
        log_rank0(f"Retrieving real inputs from storage for graph_id={graph_id}", enable=debug_log)
        return input_storage.get()
    raise RuntimeError(f"No real inputs available for graph_id {graph_id}: its input queue is empty "
                       f"({len(local_real_inputs)} entries) and its input storage holds nothing")
