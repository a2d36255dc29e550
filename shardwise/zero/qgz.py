"""qgZ (``zero_quantized_gradients``): a unit's gradient reduce-scatter becomes two all-to-alls. Rows of the
rank-major gradient bucket go to the node peer that will carry them across (the peer with the destination's
place on its node); each rank sums what it received (one partial row per node), sends those to the ranks
with its place on the other nodes, and sums what comes back: its row of the reduced bucket. As in DeepSpeed's
``all_to_all_quant_reduce``, the hop across nodes sends int4 codes with an fp32 scale a group, and only the
gradients of parameters of 2 or more dimensions whose ``numel`` divides by ``2 * world`` are quantized; the
others (biases, norms) arrive at full precision. Two choices differ from DeepSpeed's, for accuracy (measured in
docs/zero.md: DeepSpeed's int4 on both hops, in its groups, drifts past 1% of ZeRO-3's loss within 200 steps of
the reference GPT; with these the gap stays near 0.5%). The hop inside the node sends int8 (``INTRA_BITS``; DeepSpeed
sends int4): it never crosses a node boundary, so only the fast links inside the node carry the extra bytes. A
group is DeepSpeed's (``numel / max(shape[0], shape[1], world)`` elements: a row of the matrix) cut to at most
``GROUP_CAP`` (128) elements: a 4-byte scale per 128 elements adds 1/32 of a byte per element to the int4
codes' half byte, where one scale per row of thousands lets a row's largest element round the rest to zero. A row is
coded whole (``RowLayout``): the pieces of the other parameters are a block of their own each, their
full-precision values follow the codes in the same message, and the receiver keeps those. Coding the whole
row costs the codes of the unquantized elements and spares a copy of the quantized pieces out of the row and
back. Partial sums are fp32. With ``zeropp_loco_param`` (``{"err_beta": 0.8,
"reset_T": 1024}``) each quantization adds LoCo's error feedback (DeepSpeed's ``loco_swizzle_quant`` /
``loco_quantized_reduction``): the tensor sent is ``x + e``, then ``e <- err_beta * e + (1 - err_beta) *
(x + e - dequantize(quantize(x + e)))``, the buffers kept as int8 groups, cleared after every ``reset_T``
reductions of a unit. The all-to-all inside the node runs in the background while backward goes on
(``OVERLAP``); the bucket's handle finishes the chain when the reducer waits on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwise import comm
from shardwise.comm import quantize as q

INTRA_BITS = 8  # qgZ's all-to-all inside the node (DeepSpeed: int4)
INTER_BITS = 4  # qgZ's all-to-all across nodes (DeepSpeed's int4)
GROUP_CAP = 128  # qgZ: elements per quantization group at most (DeepSpeed's groups are a row: thousands)
OVERLAP = True  # qgZ: the all-to-all inside the node runs while backward goes on (False: in the hook)


# -- the reduce-scatter ----------------------------------------------------------------------------------------
class _Done:
    """The handle of a reduction already complete."""

    def wait(self) -> bool:
        return True


def deepspeed_group_size(shape, world: int) -> int | None:
    """Elements per int4 group of a gradient of ``shape`` reduced over ``world`` ranks, DeepSpeed's rule
    (``all_to_all_quant_reduce``): ``numel / max(shape[0], shape[1], world)``; None where DeepSpeed sends the
    gradient unquantized (a tensor of fewer than 2 dimensions, or ``numel`` not a multiple of ``2 * world``)."""
    shape = tuple(int(d) for d in shape)
    numel = math.prod(shape)
    if len(shape) < 2 or numel == 0 or numel % (2 * world):
        return None
    return max(1, numel // max(shape[0], shape[1], world))


def grad_group_size(shape, world: int, cap: int | None = None) -> int | None:
    """Elements per quantization group of qgZ for a gradient of ``shape``: DeepSpeed's group
    (``deepspeed_group_size``, typically one row of the matrix), at most ``cap`` (``GROUP_CAP``) elements; None
    where DeepSpeed sends the gradient unquantized."""
    g = deepspeed_group_size(shape, world)
    cap = GROUP_CAP if cap is None else cap
    return g if g is None or not cap else min(g, cap)


@dataclass
class RowLayout:
    """How qgZ codes a bucket row (one rank's shard of a unit: a piece of each parameter, in order). The whole
    row is coded in blocks (int8 inside the node, int4 across): each piece of a parameter DeepSpeed quantizes in
    groups of ``grad_group_size`` (a piece the group size does not divide ends in a shorter block), each stretch of the
    other pieces (1-D parameters and the sizes DeepSpeed sends unquantized, frozen parameters) as one block of
    its own. The trainable pieces of that second kind also travel at full precision, and the receiver keeps
    those values, not their codes; frozen positions are zero. ``width``: the row's length, rounded up to even
    (two int4 codes a byte; the extra element joins the last stretch)."""

    blocks: list[int]  # block lengths, in row order (they add up to ``width``)
    quantized: list[tuple[int, int]]  # (start, end) of the pieces DeepSpeed quantizes
    plain: list[tuple[int, int]]  # (start, end) of the other trainable pieces
    numel: int
    width: int

    @classmethod
    def of(cls, pieces, world: int) -> "RowLayout":
        """``pieces``: ``(length, shape, trainable)`` of each parameter's piece of the row, in row order."""
        blocks, quantized, plain = [], [], []
        off, stretch = 0, 0  # the length of the stretch of unquantized pieces being built
        for c, shape, trainable in pieces:
            c = int(c)
            if c == 0:
                continue
            g = grad_group_size(shape, world) if trainable else None
            if g is None:
                if trainable:
                    plain.append((off, off + c))
                stretch += c
            else:
                if stretch:
                    blocks.append(stretch)
                    stretch = 0
                quantized.append((off, off + c))
                blocks += [g] * (c // g) + ([c % g] if c % g else [])
            off += c
        width = off + (off & 1)
        stretch += width - off
        if stretch:
            blocks.append(stretch)
        return cls(blocks, _merge(quantized), _merge(plain), off, width)

    @property
    def nplain(self) -> int:
        return sum(b - a for a, b in self.plain)

    def wire_bytes(self, plain_itemsize: int, bits: int = INTER_BITS) -> int:
        """Bytes one row takes on the wire: the ``bits``-bit codes, an fp32 scale a block, the full-precision
        pieces."""
        return self.width * bits // 8 + 4 * len(self.blocks) + plain_itemsize * self.nplain


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


class RowPlan:
    """A ``RowLayout`` made ready for the quantizer: ``blocks``, the ``RowBlocks`` of the whole row (made once:
    a block number per run of ``sub`` elements, no index per element). ``quantized`` / ``plain``: the positions
    of the two kinds of pieces as index tensors, made when asked for (they take 8 bytes per element)."""

    def __init__(self, layout: RowLayout, device) -> None:
        self.layout, self.numel, self.width = layout, layout.numel, layout.width
        self.pranges = layout.plain
        self.nblocks = len(layout.blocks)
        self.device = device
        self.blocks = q.RowBlocks.of_lengths(layout.blocks).to(device)

    @property
    def quantized(self) -> torch.Tensor:
        return _positions(self.layout.quantized, self.device)

    @property
    def plain(self) -> torch.Tensor:
        return _positions(self.layout.plain, self.device)

    @classmethod
    def of_unit(cls, unit, world: int) -> "RowPlan":
        pieces = [(c, getattr(p, "ds_shape", p.shape), p.requires_grad) for p, c in zip(unit.params, unit.chunks)]
        return cls(RowLayout.of(pieces, world), unit.device)

    def wire_bytes(self, plain_itemsize: int, bits: int = INTER_BITS) -> int:
        return self.layout.wire_bytes(plain_itemsize, bits)


def _positions(ranges: list[tuple[int, int]], device) -> torch.Tensor:
    if not ranges:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)


def _take(rows: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The columns of ``rows`` in ``ranges``, side by side."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return rows[:, a:b]
    if not ranges:
        return rows[:, :0]
    return torch.cat([rows[:, a:b] for a, b in ranges], dim=1)


def _put(rows: torch.Tensor, ranges: list[tuple[int, int]], values: torch.Tensor) -> None:
    """The inverse of ``_take``: write ``values``' columns back into ``rows`` at ``ranges``."""
    k = 0
    for a, b in ranges:
        rows[:, a:b].copy_(values[:, k : k + b - a])
        k += b - a


class _ErrorFeedback:
    """A LoCo error buffer (the rows as coded, ``[R, width]``), kept as int8 blocks between reductions."""

    def __init__(self) -> None:
        self.values = self.scales = None

    def get(self, like: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        if self.values is None:
            return torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        return q.dequantize_rows(self.values, self.scales, plan.blocks, 8)

    def put(self, err: torch.Tensor, plan: RowPlan) -> None:
        values, scales = q.quantize_rows(err, plan.blocks, plan.nblocks, 8)
        # A block whose error is not finite (the gradients overflowed: fp16, a step the loss scaler skips) starts
        # again from zero; kept, it would turn every later gradient of the block into inf/NaN, and every later
        # step would be skipped as an overflow.
        self.values, self.scales = values, torch.where(torch.isfinite(scales), scales, torch.zeros_like(scales))

    def clear(self) -> None:
        self.values = self.scales = None

    def nbytes(self) -> int:
        return 0 if self.values is None else self.values.nbytes + self.scales.nbytes


def _encode(x: torch.Tensor, plan: RowPlan, err: _ErrorFeedback | None, beta: float, dtype, bits: int) -> torch.Tensor:
    """The rows to send as bytes: ``[R, wire_bytes]``, each row its ``bits``-bit codes, fp32 scales and plain pieces
    (in ``dtype``). ``x`` (``[R, width]``) is quantized with LoCo's error feedback if ``err``; the plain pieces
    go as they are in ``x``."""
    plain = _take(x, plan.pranges).to(dtype)
    if err is not None:
        e = err.get(x, plan)
        x = x.float() + e
    values, scales = q.quantize_rows(x, plan.blocks, plan.nblocks, bits)
    if err is not None:
        new = x - q.dequantize_rows(values, scales, plan.blocks, bits)
        err.put(beta * e + (1.0 - beta) * new, plan)
    r = x.shape[0]
    return torch.cat([values, scales.view(torch.uint8).view(r, -1), plain.contiguous().view(torch.uint8).view(r, -1)],
                     dim=1)


def _decode_sum(buf: torch.Tensor, plan: RowPlan, dtype: torch.dtype, groups: int, bits: int) -> torch.Tensor:
    """Received rows, decoded and summed over ``groups`` consecutive sets of rows (``dequantize_rows_sum``): fp32
    ``[R / groups, width]``, the plain pieces summed at full precision in place of their codes."""
    nq, nb = plan.width * bits // 8, 4 * plan.nblocks
    values = buf[:, :nq]
    scales = buf[:, nq:nq + nb].contiguous().view(torch.float32)
    out = q.dequantize_rows_sum(values, scales, plan.blocks, bits, groups)
    if plan.pranges:
        plain = buf[:, nq + nb:].contiguous().view(dtype)
        _put(out, plan.pranges, plain.float().view(groups, plain.shape[0] // groups, -1).sum(dim=0))
    return out


class _Pending:
    """qgZ's reduction of one bucket with its first all-to-all (inside the node) in flight: ``wait()`` sums
    what arrived, runs the all-to-all across nodes and writes this rank's row of the reduced bucket."""

    def __init__(self, owner: "HierarchicalReduceScatter", out, plan, recv, work, errs, dtype) -> None:
        self.owner, self.out, self.plan, self.recv, self.work, self.errs = owner, out, plan, recv, work, errs
        self.dtype = dtype
        self.send = None
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            self.done = True
            if self.work is not None:
                self.work.wait()
                self.work = self.send = None
            self.owner._finish(self)
        return True


class HierarchicalReduceScatter:
    """qgZ's reduce-scatter of a rank-major gradient bucket (the ``BucketReducer`` hook).

    A row of the bucket is one rank's shard of a unit: a piece of each of its parameters. The pieces of the
    parameters DeepSpeed quantizes (2-D and more, ``numel`` a multiple of ``2 * world``) travel as int8 (inside
    the node) or int4 (across nodes) groups (``grad_group_size``) with an fp32 scale each; the other trainable
    parameters' pieces (biases, norms: DeepSpeed reduces those with a plain reduce-scatter) travel alongside at
    full precision, in the same message. Partial sums are fp32. With ``overlap`` the first all-to-all runs in
    the background while backward goes on; the handle's ``wait()`` finishes the chain."""

    def __init__(self, pp, bucket_units) -> None:  # pp: zeropp.ZeroPP
        self.pp = pp
        self.bucket_units = list(bucket_units)  # bucket position -> the Unit whose gradients it holds
        self.overlap = OVERLAP
        self.plans: dict[int, RowPlan] = {}
        nodes = pp.nodes
        index = {r: i for i, r in enumerate(pp.dp_ranks)}  # global rank -> row of the bucket
        local_ranks = list(nodes.ranks)
        cross_ranks = list(nodes.cross_ranks)
        self.L, self.M = len(local_ranks), len(cross_ranks)
        # rows[l'][m'] = the bucket row of the data rank at place l' on node m' (nodes in the order of this
        # rank's inter-node group; a node's ranks in their global order).
        size = pp.node_size
        node_of = {r: r // size for r in pp.dp_ranks}
        members: dict[int, list[int]] = {}
        for r in pp.dp_ranks:
            members.setdefault(node_of[r], []).append(r)
        order = [node_of[r] for r in cross_ranks]
        rows = [[index[sorted(members[n])[lp]] for n in order] for lp in range(self.L)]
        self.send_order = torch.tensor([r for per_place in rows for r in per_place], dtype=torch.long)
        self.errors: dict[int, tuple[_ErrorFeedback, _ErrorFeedback]] = {}
        self.counts: dict[int, int] = {}

    def plan(self, bucket) -> RowPlan:
        if bucket.index not in self.plans:
            self.plans[bucket.index] = RowPlan.of_unit(self.bucket_units[bucket.position], len(self.pp.dp_ranks))
        return self.plans[bucket.index]

    def _loco(self, bucket):
        loco = self.pp.loco
        if loco is None:
            return None
        errs = self.errors.setdefault(bucket.index, (_ErrorFeedback(), _ErrorFeedback()))
        self.counts[bucket.index] = self.counts.get(bucket.index, 0) + 1
        if self.counts[bucket.index] > int(loco["reset_T"]):
            self.counts[bucket.index] = 1
            errs[0].clear()
            errs[1].clear()
        return errs

    def __call__(self, bucket, out: torch.Tensor, data: torch.Tensor, group):
        if not self.pp.applies_to(group):
            return comm.reduce_scatter_tensor(out, data, group=group, async_op=True)
        world = len(self.pp.dp_ranks)
        plan = self.plan(bucket)
        rows = data.view(world, plan.numel)
        if plan.width != plan.numel:  # an odd row: int4 codes go two a byte
            rows = F.pad(rows, (0, plan.width - plan.numel))
        errs = self._loco(bucket)
        # Stage 1, inside the node: to local peer l' the rows of the destinations at place l' on every node
        # (``send_order``; rows are encoded independently, so the encoded rows are put in that order).
        order = self.send_order.to(rows.device)
        pending = _Pending(self, out, plan, None, None, errs, data.dtype)
        if self.L == 1:  # one rank a node: nothing to send inside it
            pending.recv = rows.index_select(0, order).float()  # (partial sums of one)
            self._cross(pending)
            return _Done()
        buf = _encode(rows, plan, errs[0] if errs else None, self._beta(), data.dtype, INTRA_BITS)
        buf = buf.index_select(0, order)
        recv = torch.empty_like(buf)
        pending.recv, pending.send = recv, buf  # (the send buffer lives until the all-to-all is done)
        pending.work = comm.all_to_all_single(recv, buf, group=self.pp.nodes.group, async_op=self.overlap)
        if not self.overlap:
            pending.wait()
            return _Done()
        return pending

    def loco_bytes(self) -> int:
        """Bytes of LoCo's error buffers now held (int8 codes and fp32 scales: for every gradient bucket, all the
        ranks' rows of it and this rank's partial sums; allocated on a bucket's first reduction)."""
        return sum(e.nbytes() for pair in self.errors.values() for e in pair)

    def _beta(self) -> float:
        return float(self.pp.loco["err_beta"]) if self.pp.loco is not None else 0.0

    def _finish(self, pending: _Pending) -> None:
        """After the all-to-all inside the node: decode what arrived, then reduce across nodes."""
        pending.recv = _decode_sum(pending.recv, pending.plan, pending.dtype, self.L, INTRA_BITS)
        self._cross(pending)

    def _cross(self, pending: _Pending) -> None:
        plan, out, errs = pending.plan, pending.out, pending.errs
        partial = pending.recv  # [M, width]: this node's sums for the destinations at this rank's place
        if self.M > 1:  # Stage 2, across nodes: to node m' its destination's partial row
            buf = _encode(partial, plan, errs[1] if errs else None, self._beta(), pending.dtype, INTER_BITS)
            recv = torch.empty_like(buf)
            comm.all_to_all_single(recv, buf, group=self.pp.nodes.cross_group)
            partial = _decode_sum(recv, plan, pending.dtype, self.M, INTER_BITS)
        out.copy_(partial[0, : plan.numel])
        pending.recv = None
