"""ZeRO++ on top of stage 3: quantized weight gathers (qwZ), a node-local second copy of the weights for the
backward gathers (hpZ), and a hierarchical, quantized gradient reduce-scatter (qgZ).

Nodes: a rank's node is ``global_rank // node_size``, with ``node_size`` = ``zero_hpz_partition_size``
when it is above 1, else the launcher's ranks per node (``LOCAL_WORLD_SIZE``). The data-parallel ranks are
cut by node into a node group (the data ranks on one node) and an inter-node group (the k-th data rank of
every node): the grid's ``node`` and ``inter_node`` groups (``ParallelGrid.node_groups``).

qwZ (``zero_quantized_weights``): a unit's all-gather sends this rank's shard as int8 blocks with one fp32
scale per block (``comm/quantize.py``; DeepSpeed's group layout), and every rank dequantizes what arrives.
All ranks then hold the same (dequantized) full weights, this rank's own part included.

hpZ (``zero_hpz_partition_size: k``): when a unit is gathered with autograd on, each rank also keeps a
secondary shard of the gathered unit, the unit's flat weights cut in k pieces over its node group. Until
the end of the pass (the end of backward, an optimizer step) the unit's gathers, those of backward
included, all-gather the secondary shards inside the node: nothing crosses a node boundary. The secondary
buffers stay allocated (``memory_parts()["hpz_secondary"]``).

qgZ (``zero_quantized_gradients``): a hierarchical, quantized reduce-scatter of the gradient buckets, in
``zero/qgz.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from shardwise import comm
from shardwise.comm import quantize as q

if TYPE_CHECKING:
    from shardwise.zero.qgz import HierarchicalReduceScatter

LOCO_DEFAULTS = {"err_beta": 0.8, "reset_T": 1024}


def _group_ranks(group) -> list[int]:
    return list(range(comm.get_world_size())) if group is None else torch.distributed.get_process_group_ranks(group)


def node_size_of(zero_config, world: int) -> int:
    """Ranks per node: ``zero_hpz_partition_size`` when above 1, else the launcher's ``LOCAL_WORLD_SIZE``."""
    hpz = int(getattr(zero_config, "zero_hpz_partition_size", 1) or 1)
    if hpz > 1:
        return hpz
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local else world


def _loco_param(zero_config) -> dict | None:
    loco = getattr(zero_config, "zeropp_loco_param", None)
    if loco is None:
        return None
    loco = dict(loco) if not hasattr(loco, "model_dump") else loco.model_dump()
    return {**LOCO_DEFAULTS, **loco}


@dataclass
class ZeroPP:
    """What of ZeRO++ is on, and the node groups it uses."""

    quantized_weights: bool
    hpz: int
    quantized_gradients: bool
    loco: dict | None
    node_size: int
    dp_group: object
    dp_ranks: list[int]
    nodes: object = None  # topology.NodeGroups
    reducer: "HierarchicalReduceScatter | None" = field(default=None, repr=False)

    def applies_to(self, group) -> bool:
        """Whether a unit (or gradient bucket) sharded over ``group`` takes the ZeRO++ paths: the data
        axis only (expert parameters keep plain stage 3)."""
        return group is self.dp_group or _group_ranks(group) == self.dp_ranks


def setup(zero_config, *, dp_group, bucket_units=()) -> ZeroPP | None:
    """The ZeRO++ settings of a stage-3 ``zero_optimization`` block, None when none is on. Collective
    (node groups are created on first use). ``bucket_units``: per gradient bucket, the unit it holds (qgZ
    reads the parameters' shapes from it)."""
    if zero_config is None:
        return None
    qw = bool(getattr(zero_config, "zero_quantized_weights", False))
    qg = bool(getattr(zero_config, "zero_quantized_gradients", False))
    hpz = int(getattr(zero_config, "zero_hpz_partition_size", 1) or 1)
    if not (qw or qg or hpz > 1):
        return None
    world = comm.get_world_size(dp_group)
    ranks = _group_ranks(dp_group)
    pp = ZeroPP(quantized_weights=qw, hpz=hpz, quantized_gradients=qg, loco=_loco_param(zero_config),
                node_size=node_size_of(zero_config, world), dp_group=dp_group, dp_ranks=ranks)
    if world > 1 and (hpz > 1 or qg):
        pp.nodes = _node_groups(dp_group, ranks, pp.node_size)
        pp.node_size = pp.nodes.node_size  # (the grid's: the plan's node size)
        if hpz > 1 and pp.nodes.size != hpz:
            raise ValueError(f"zero_optimization.zero_hpz_partition_size={hpz}: this rank's node holds "
                             f"{pp.nodes.size} of the data-parallel ranks {ranks}; the hpZ group must be "
                             "the data ranks of one node")
    if qg and world > 1:
        from shardwise.zero.qgz import HierarchicalReduceScatter

        pp.reducer = HierarchicalReduceScatter(pp, bucket_units)
    return pp


def _node_groups(dp_group, ranks: list[int], node_size: int):
    """The node groups of the grid (built with every other group, ``ParallelDims.node_size``) whose data axis
    ``ranks`` are; else, with the whole world as the data axis (ZeRO-3 built outside ``initialize``), the
    world's."""
    from shardwise import topology

    grid = topology.active_grid()
    if grid is not None and grid.node_size > 0 and any(sorted(r) == sorted(ranks) for r in grid.data_rank_lists()):
        return grid.node_groups()
    if dp_group is None or ranks == list(range(comm.get_world_size())):
        return topology.world_node_groups(node_size)
    raise ValueError(f"ZeRO++ (hpZ / qgZ) over data-parallel ranks {ranks}: the engine's grid has no node groups "
                     "over them; build the engine with shardwise.initialize (its grid has them), or pass a grid "
                     "built with ParallelGrid.from_dims(dims) whose dims.node_size is the ranks per node")


# -- qwZ ----------------------------------------------------------------------------------------
class QuantizedGather:
    """An all-gather of int8 blocks and their scales in flight; ``wait()`` dequantizes into ``out`` (the
    ``world x numel`` rank-major rows a plain all-gather would fill)."""

    def __init__(self, out: torch.Tensor, shard: torch.Tensor, *, group, world: int, block: int,
                 async_op: bool = True) -> None:
        n = shard.numel()
        padded = q.padded_numel(n, block)
        x = shard if padded == n else F.pad(shard.reshape(-1), (0, padded - n))
        values, scales = q.quantize(x, block, 8)
        self.out, self.world, self.n, self.padded, self.block = out, world, n, padded, block
        self.values = torch.empty(world * values.numel(), dtype=values.dtype, device=values.device)
        self.scales = torch.empty(world * scales.numel(), dtype=scales.dtype, device=scales.device)
        self.works = [comm.all_gather_into_tensor(self.values, values, group=group, async_op=async_op),
                      comm.all_gather_into_tensor(self.scales, scales, group=group, async_op=async_op)]

    def wait(self) -> bool:
        for w in self.works:
            if w is not None:
                w.wait()
        self.works = []
        q.dequantize_into(self.out.view(self.world, self.n), self.values, self.scales, self.block, 8)
        return True


# -- zero_quantized_nontrainable_weights ------------------------------------------------------------
class _Ready:
    def result(self):
        return None


class QuantizedShardStore:
    """Where the shards of frozen units live under ``zero_quantized_nontrainable_weights``: as int8 blocks
    with their scales (the qwZ layout of each shard), in memory. It answers the unit as the NVMe store does
    (``Unit.offload_to_nvme``): a shard is dequantized into a buffer when it is read (a gather, a checkpoint),
    and quantized again when written (a loaded checkpoint). Gathered with qwZ on, the int8 codes go out as
    they are stored (quantizing dequantized values with the same blocks gives the same codes)."""

    def __init__(self) -> None:
        self.shards: dict[str, tuple[torch.Tensor, torch.Tensor, int, int]] = {}

    def write_async(self, name: str, tensor: torch.Tensor) -> _Ready:
        n = tensor.numel()
        block = q.weight_block_size(n)
        padded = q.padded_numel(n, block)
        flat = tensor.detach().reshape(-1)
        x = flat if padded == n else F.pad(flat, (0, padded - n))
        values, scales = q.quantize(x, block, 8)
        self.shards[name] = (values, scales, block, n)
        return _Ready()

    def read_async(self, name: str, out: torch.Tensor) -> _Ready:
        values, scales, block, n = self.shards[name]
        out.copy_(q.dequantize(values, scales, block, 8)[:n])
        return _Ready()

    def nbytes(self) -> int:
        return sum(v.nbytes + s.nbytes for v, s, _, _ in self.shards.values())

    def disk_bytes(self) -> int:
        return 0
