"""DeepCompile's per-graph profiling results (``deepspeed.compile.profilers``)."""
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from torch.fx import Graph


@dataclass
class ProfilingResult:
    """What profiling learned about one compiled graph: its forward/backward graphs, whether it needs a
    backward, how many forward outputs the caller gets (None before partitioning), per-node memory
    records ``(name, current_alloc, delta, peak)`` and whether they cover the whole graph, per-node times
    ``(name, device_time, wall_time)``, tensor sizes ``(name, size)`` and the parameter inputs
    ``(index, ds_id, ds_shape)``."""
    fwd_graph: Graph = None
    bwd_graph: Graph = None
    needs_backward: bool = False
    num_fwd_outputs: Optional[int] = None
    fwd_mem: List[Tuple[str, int, int, int]] = field(default_factory=list)
    bwd_mem: List[Tuple[str, int, int, int]] = field(default_factory=list)
    fwd_mem_complete: bool = True
    bwd_mem_complete: bool = True
    fwd_time: List[Tuple[str, int, int]] = field(default_factory=list)
    bwd_time: List[Tuple[str, int, int]] = field(default_factory=list)
    fwd_tensor_sizes: List[Tuple[str, int]] = field(default_factory=list)
    bwd_tensor_sizes: List[Tuple[str, int]] = field(default_factory=list)
    param_indices: List[Tuple[int, int, Tuple[int, ...]]] = field(default_factory=list)
