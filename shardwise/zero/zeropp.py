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

qgZ (``zero_quantized_gradients``): a unit's gradient reduce-scatter becomes two all-to-alls. Rows of the
rank-major gradient bucket go, as int4 blocks, to the node peer that will carry them across (the peer with
the destination's place on its node); each rank sums what it received (one partial row per node), sends
those as int4 blocks to the ranks with its place on the other nodes, and sums what comes back: its row of
the reduced bucket. With ``zeropp_loco_param`` (``{"err_beta": 0.8, "reset_T": 1024}``) each quantization
adds the error feedback of LoCo, as DeepSpeed 0.19 does: the tensor sent is ``x + e``, then
``e <- err_beta * e + (1 - err_beta) * (x + e - dequantize(quantize(x + e)))``, the buffers kept as int8
blocks, cleared after every ``reset_T`` reductions of a unit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from shardwise import comm
from shardwise.comm import quantize as q

GRAD_BLOCK = 256  # elements per int4 block of a gradient row (qgZ)
GRAD_BITS = 4  # DeepSpeed's all_to_all_quant_reduce sends int4
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


def setup(zero_config, *, dp_group) -> ZeroPP | None:
    """The ZeRO++ settings of a stage-3 ``zero_optimization`` block, None when none is on. Collective
    (node groups are created on first use)."""
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
        pp.reducer = HierarchicalReduceScatter(pp)
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
        full = q.dequantize(self.values, self.scales, self.block, 8).view(self.world, self.padded)
        self.out.view(self.world, self.n).copy_(full[:, : self.n])
        return True


# -- qgZ ----------------------------------------------------------------------------------------
class _Done:
    """The handle of a reduction already complete."""

    def wait(self) -> bool:
        return True


class _ErrorFeedback:
    """A LoCo error buffer, kept as int8 blocks between reductions."""

    def __init__(self) -> None:
        self.values = self.scales = None

    def get(self, numel: int, block: int, device) -> torch.Tensor:
        if self.values is None:
            return torch.zeros(numel, device=device)
        return q.dequantize(self.values, self.scales, block, 8)

    def put(self, err: torch.Tensor, block: int) -> None:
        self.values, self.scales = q.quantize(err, block, 8)

    def clear(self) -> None:
        self.values = self.scales = None


def _send_quantized(x: torch.Tensor, block: int, err: _ErrorFeedback | None, beta: float):
    """int4 blocks of ``x`` (flat, a multiple of ``block``), with LoCo error feedback if ``err``."""
    if err is None:
        return q.quantize(x, block, GRAD_BITS)
    e = err.get(x.numel(), block, x.device)
    compensated = x + e
    values, scales = q.quantize(compensated, block, GRAD_BITS)
    new_err = compensated - q.dequantize(values, scales, block, GRAD_BITS)
    err.put(beta * e + (1.0 - beta) * new_err, block)
    return values, scales


def _all_to_all(values: torch.Tensor, scales: torch.Tensor, group):
    out_v, out_s = torch.empty_like(values), torch.empty_like(scales)
    comm.all_to_all_single(out_v, values, group=group)
    comm.all_to_all_single(out_s, scales, group=group)
    return out_v, out_s


class HierarchicalReduceScatter:
    """qgZ's reduce-scatter of a rank-major gradient bucket (the ``BucketReducer`` hook)."""

    def __init__(self, pp: ZeroPP) -> None:
        self.pp = pp
        nodes = pp.nodes
        index = {r: i for i, r in enumerate(pp.dp_ranks)}  # global rank -> row of the bucket
        # Global ranks of the nodes, node by node, each in local order: node m's local rank l.
        local_ranks = list(nodes.ranks)
        cross_ranks = list(nodes.cross_ranks)
        self.L, self.M = len(local_ranks), len(cross_ranks)
        self.l, self.m = nodes.rank, nodes.node
        # rows[l'][m'] = the bucket row of the data rank at place l' on node m'. Node m' of this rank's
        # place l is cross_ranks[m']; its node's ranks are those of the same node (global // node_size).
        size = pp.node_size
        node_of = {r: r // size for r in pp.dp_ranks}
        members: dict[int, list[int]] = {}
        for r in pp.dp_ranks:
            members.setdefault(node_of[r], []).append(r)
        order = [node_of[r] for r in cross_ranks]  # node ids in inter-node group order
        self.rows = [[index[sorted(members[n])[lp]] for n in order] for lp in range(self.L)]
        self.errors: dict[int, tuple[_ErrorFeedback, _ErrorFeedback]] = {}
        self.counts: dict[int, int] = {}

    def __call__(self, bucket, out: torch.Tensor, data: torch.Tensor, group):
        if not self.pp.applies_to(group):
            return comm.reduce_scatter_tensor(out, data, group=group, async_op=True)
        world = len(self.pp.dp_ranks)
        S = data.numel() // world
        block = min(GRAD_BLOCK, max(2, S + (S & 1)))
        Sp = q.padded_numel(S, block)
        rows = data.view(world, S).float()
        if Sp != S:
            rows = F.pad(rows, (0, Sp - S))
        loco = self.pp.loco
        errs = None
        if loco is not None:
            errs = self.errors.setdefault(bucket.index, (_ErrorFeedback(), _ErrorFeedback()))
            self.counts[bucket.index] = self.counts.get(bucket.index, 0) + 1
            if self.counts[bucket.index] > int(loco["reset_T"]):
                self.counts[bucket.index] = 0
                errs[0].clear()
                errs[1].clear()
        beta = float(loco["err_beta"]) if loco is not None else 0.0
        nodes = self.pp.nodes
        # Stage 1, inside the node: to local peer l' the rows of the destinations at place l' on every node.
        send = torch.stack([rows[self.rows[lp]] for lp in range(self.L)])  # [L, M, Sp]
        if self.L > 1:
            values, scales = _send_quantized(send.reshape(-1), block, errs[0] if errs else None, beta)
            values, scales = _all_to_all(values, scales, nodes.group)
            # [M, Sp]: this node's sum for the destinations at place l
            partial = q.dequantize_sum(values, scales, block, GRAD_BITS, self.L).view(self.M, Sp)
        else:
            partial = send[0]
        # Stage 2, across nodes: to node m' its destination's partial row.
        if self.M > 1:
            values, scales = _send_quantized(partial.reshape(-1), block, errs[1] if errs else None, beta)
            values, scales = _all_to_all(values, scales, nodes.cross_group)
            mine = q.dequantize_sum(values, scales, block, GRAD_BITS, self.M)
        else:
            mine = partial[0]
        out.copy_(mine[:S])
        return _Done()


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
