"""``deepspeed.moe.ep_tp_dispatch``: DeepSpeed's split of routed (token, expert) assignments across the
tensor-parallel lanes of an AutoEP + AutoTP "folded" layer, and the restore that sums the experts' outputs
back per token.

* ``assignment_ordinals_by_expert``: each assignment's position inside its run of equal expert ids;
* ``partition_assignments``: lane ``r`` of ``tp`` keeps the active (not dropped, not padding) assignments
  whose ordinal is ``r`` mod ``tp``, so the lanes together carry each assignment once;
* ``restore_combined``: gathers every lane's rows (differentiably: the backward sums the replicated
  gradient over the lanes and keeps this lane's rows) and adds ``output * combine_weight`` into each
  original token, one top-k slot at a time so the order of the additions is fixed;
* ``assert_tp_payload_consistent``: all lanes must start from the same routing (a digest compared by MAX
  and MIN all-reduce), else ``RuntimeError``.

The collectives run on ``deepspeed.comm`` (shardwise's); with ``tp_size`` 1 or no process group nothing is
communicated. shardwise's own AutoEP does not fold experts onto tensor lanes (``shardwise.moe``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import deepspeed.comm as dist

__all__ = ["RestoreContext", "RoutedAssignmentPayload", "assert_tp_payload_consistent",
           "assignment_ordinals_by_expert", "average_gradient_over_tp", "dispatch_counters", "dist",
           "partition_assignments", "restore_combined"]

_DIGEST_MODULI = (2147483647, 2147483629)


@dataclass
class RoutedAssignmentPayload:
    token_indices: torch.Tensor
    expert_indices: torch.Tensor
    assignment_indices: torch.Tensor
    capacity_slots: torch.Tensor
    combine_weights: torch.Tensor
    drop_mask: torch.Tensor
    pad_mask: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    extra: dict[str, torch.Tensor]


@dataclass
class RestoreContext:
    original_payload: RoutedAssignmentPayload
    local_indices: torch.Tensor
    tp_rank: int
    tp_size: int
    num_tokens: int
    counters: dict[str, int]


def assignment_ordinals_by_expert(expert_indices: torch.Tensor) -> torch.Tensor:
    """For each position, how many earlier positions of the same contiguous expert run precede it."""
    n = expert_indices.numel()
    if n == 0:
        return expert_indices.to(torch.long)
    positions = torch.arange(n, device=expert_indices.device, dtype=torch.long)
    run_start = torch.ones(n, device=expert_indices.device, dtype=torch.bool)
    run_start[1:] = expert_indices[1:] != expert_indices[:-1]
    starts = torch.where(run_start, positions, torch.zeros_like(positions)).cummax(dim=0).values
    return positions - starts


def _rows(payload: RoutedAssignmentPayload, indices: torch.Tensor) -> RoutedAssignmentPayload:
    n = payload.token_indices.shape[:1]
    return RoutedAssignmentPayload(
        token_indices=payload.token_indices.index_select(0, indices),
        expert_indices=payload.expert_indices.index_select(0, indices),
        assignment_indices=payload.assignment_indices.index_select(0, indices),
        capacity_slots=payload.capacity_slots.index_select(0, indices),
        combine_weights=payload.combine_weights.index_select(0, indices),
        drop_mask=payload.drop_mask.index_select(0, indices),
        pad_mask=payload.pad_mask.index_select(0, indices),
        input_splits=list(payload.input_splits),
        output_splits=list(payload.output_splits),
        # per-assignment extras follow the rows; the others (e.g. num_tokens) are kept as they are
        extra={k: v.index_select(0, indices) if torch.is_tensor(v) and v.shape[:1] == n else v
               for k, v in payload.extra.items()},
    )


def _active(payload: RoutedAssignmentPayload) -> torch.Tensor:
    return ~payload.drop_mask & ~payload.pad_mask


def partition_assignments(payload: RoutedAssignmentPayload, *, tp_group, tp_rank: int,
                          tp_size: int) -> tuple[RoutedAssignmentPayload, RestoreContext]:
    """This lane's share of the active assignments (see the module) and the context to restore from. The
    local payload's splits are recounted from ``extra["destination_ranks"]`` when present."""
    keep = _active(payload)
    if tp_size > 1:
        keep = keep & (payload.assignment_indices.remainder(tp_size) == tp_rank)
    local_indices = torch.nonzero(keep, as_tuple=False).flatten()
    local = _rows(payload, local_indices)
    destinations = local.extra.get("destination_ranks")
    if destinations is not None and payload.input_splits:
        counts = torch.bincount(destinations.to(torch.long), minlength=len(payload.input_splits))
        local.input_splits = [int(c) for c in counts[:len(payload.input_splits)].tolist()]
    elif destinations is not None:
        local.input_splits = []
    local.output_splits = list(local.input_splits)
    num_tokens = payload.extra.get("num_tokens", 0)
    ctx = RestoreContext(
        original_payload=payload, local_indices=local_indices, tp_rank=tp_rank, tp_size=tp_size,
        num_tokens=int(num_tokens.item()) if torch.is_tensor(num_tokens) else int(num_tokens),
        counters={"assignments_total": int(_active(payload).sum().item()),
                  "assignments_local": int(local_indices.numel()),
                  "padded": int(payload.pad_mask.sum().item()),
                  "dropped": int(payload.drop_mask.sum().item()),
                  "split_sum_in": int(sum(local.input_splits)),
                  "split_sum_out": int(sum(local.output_splits))})
    return local, ctx


def dispatch_counters(ctx: RestoreContext) -> dict[str, int]:
    """A copy of the partition's counters (total / local assignments, padded, dropped, split sums)."""
    return dict(ctx.counters)


# -- the lanes' consistency check -------------------------------------------------------------------
def _words(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    if tensor.is_floating_point():
        finite = torch.nan_to_num(tensor.float(), nan=0.0, posinf=3.4028235e38, neginf=-3.4028235e38)
        return finite.mul(1000003.0).round().to(torch.long).reshape(-1)
    return tensor.to(torch.long).reshape(-1)


def _field_digest(words: torch.Tensor, salt: int, modulus: int) -> torch.Tensor:
    if words.numel() == 0:
        return torch.tensor(salt, device=words.device, dtype=torch.long)
    weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.long).add_(salt).remainder_(modulus)
    total = words.remainder(modulus).mul(weights).remainder_(modulus).sum()
    return total.add_(words.numel() * salt).remainder_(modulus)


def _payload_digest(payload: RoutedAssignmentPayload) -> torch.Tensor:
    device = payload.token_indices.device
    digest = torch.tensor([payload.token_indices.numel(), int(sum(payload.input_splits)),
                           int(sum(payload.output_splits)), 0, 0], device=device, dtype=torch.long)
    fields = (payload.token_indices, payload.expert_indices, payload.assignment_indices, payload.capacity_slots,
              payload.combine_weights, payload.drop_mask, payload.pad_mask, _active(payload).to(torch.long),
              payload.extra.get("destination_ranks", torch.empty(0, device=device, dtype=torch.long)))
    for index, field in enumerate(fields, start=1):
        if torch.is_tensor(field):
            words = _words(field)
            for slot, (salt, modulus) in enumerate(((17 * index, _DIGEST_MODULI[0]), (31 * index, _DIGEST_MODULI[1]))):
                digest[3 + slot] = (digest[3 + slot] + _field_digest(words, salt, modulus)) % modulus
    return digest


def assert_tp_payload_consistent(payload: RoutedAssignmentPayload, *, tp_group, tp_size: int) -> None:
    """``RuntimeError`` unless every lane of ``tp_group`` holds the same routing (nothing to check with one
    lane or without a process group)."""
    if tp_size <= 1 or not dist.is_initialized():
        return
    digest = _payload_digest(payload)
    high, low = digest.clone(), digest.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=tp_group)
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=tp_group)
    if not torch.equal(high, low):
        raise RuntimeError("AutoEP+AutoTP routing decisions differ across tensor-parallel lanes. Folded dispatch "
                           "requires identical routed-token payloads before TP partitioning "
                           f"(digest here {digest.tolist()}, lanes' min {low.tolist()}, max {high.tolist()}).")


# -- gathering the lanes' rows ----------------------------------------------------------------------
def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    return torch.cat((tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))), dim=0)


def _gather_padded(tensor, group, counts, rows):
    chunks = [torch.zeros_like(_padded(tensor, rows)) for _ in counts]
    dist.all_gather(chunks, _padded(tensor, rows), group=group)
    return torch.cat([chunk[:n] for chunk, n in zip(chunks, counts)], dim=0)


class _GatherRows(torch.autograd.Function):
    """All-gather of a different number of rows per lane. The result is the same on every lane and used
    alike, so the backward sums the lanes' gradients and returns this lane's rows."""

    @staticmethod
    def forward(ctx, tensor, group, counts, rows):
        ctx.group, ctx.counts, ctx.rows = group, counts, rows
        ctx.lane = dist.get_rank(group=group)
        if rows == 0:
            return tensor.new_empty((0, *tensor.shape[1:]))
        return _gather_padded(tensor, group, counts, rows)

    @staticmethod
    def backward(ctx, grad):
        if ctx.rows == 0:
            return grad.new_empty((0, *grad.shape[1:])), None, None, None
        mine = None
        for lane, (piece, n) in enumerate(zip(torch.split(grad, list(ctx.counts), dim=0), ctx.counts)):
            summed = grad.new_zeros((ctx.rows, *grad.shape[1:]))
            summed[:n].copy_(piece)
            dist.all_reduce(summed, group=ctx.group)  # every lane takes part in every lane's reduction
            if lane == ctx.lane:
                mine = summed[:n].contiguous()
        return mine, None, None, None


def _gather_rows(tensor: torch.Tensor, group, tp_size: int, *, preserve_grad: bool = False) -> torch.Tensor:
    if tp_size <= 1 or not dist.is_initialized():
        return tensor
    mine = torch.tensor([tensor.shape[0]], dtype=torch.long, device=tensor.device)
    counts = [torch.zeros_like(mine) for _ in range(tp_size)]
    dist.all_gather(counts, mine, group=group)
    counts = tuple(int(c.item()) for c in counts)
    rows = max(counts) if counts else tensor.shape[0]
    if preserve_grad:
        return _GatherRows.apply(tensor, group, counts, rows)
    return _gather_padded(tensor, group, counts, rows)


def _check_coverage(payload, tokens, experts, ordinals, slots) -> None:
    active = _active(payload)
    want = torch.stack([payload.token_indices[active], payload.expert_indices[active],
                        payload.assignment_indices[active], payload.capacity_slots[active]], dim=1).to(torch.long)
    got = torch.stack([tokens, experts, ordinals, slots], dim=1).to(torch.long)
    if want.numel() == 0 and got.numel() == 0:
        return
    if got.shape[0] != want.shape[0]:
        raise RuntimeError(f"AutoEP+AutoTP restore coverage mismatch: gathered assignment count {got.shape[0]} != "
                           f"expected {want.shape[0]}")
    if got.shape[0] <= 4096:
        want_set = {tuple(r) for r in want.tolist()}
        got_set = {tuple(r) for r in got.tolist()}
        if want_set != got_set:
            raise RuntimeError(f"AutoEP+AutoTP restore coverage mismatch: missing={sorted(want_set - got_set)[:5]} "
                               f"unexpected={sorted(got_set - want_set)[:5]}")


def restore_combined(local_combined: torch.Tensor, ctx: RestoreContext, *, tp_group,
                     validate_coverage: bool = False) -> torch.Tensor:
    """``[num_tokens, hidden]``: every lane's expert outputs gathered and summed into their tokens, each
    weighted by its combine weight (gradients reach both the outputs and the weights). With
    ``validate_coverage`` the gathered assignments must be exactly the active ones (``RuntimeError``)."""
    payload, idx = ctx.original_payload, ctx.local_indices
    tokens = payload.token_indices.index_select(0, idx)
    slots = payload.capacity_slots.index_select(0, idx)
    weights = payload.combine_weights.index_select(0, idx).to(local_combined.dtype)

    outputs = _gather_rows(local_combined, tp_group, ctx.tp_size, preserve_grad=local_combined.requires_grad)
    tokens = _gather_rows(tokens, tp_group, ctx.tp_size).to(torch.long)
    slots = _gather_rows(slots, tp_group, ctx.tp_size).to(torch.long)
    weights = _gather_rows(weights, tp_group, ctx.tp_size, preserve_grad=weights.requires_grad)
    if validate_coverage:
        experts = _gather_rows(payload.expert_indices.index_select(0, idx), tp_group, ctx.tp_size)
        ordinals = _gather_rows(payload.assignment_indices.index_select(0, idx), tp_group, ctx.tp_size)
        _check_coverage(payload, tokens, experts, ordinals, slots)

    if ctx.num_tokens <= 0:
        ctx.num_tokens = int(payload.token_indices.max().item()) + 1 if payload.token_indices.numel() else 0
    result = local_combined.new_zeros((ctx.num_tokens, local_combined.shape[-1]))
    if outputs.numel():
        weighted = outputs * weights.to(local_combined.dtype).reshape((-1, ) + (1, ) * (outputs.dim() - 1))
        for slot in torch.unique(slots, sorted=True).tolist():
            rows = slots == slot
            result.index_add_(0, tokens[rows], weighted[rows])
    return result


class _AverageOverTP(torch.autograd.Function):

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad.div_(dist.get_world_size(group=ctx.group)), None


def average_gradient_over_tp(tensor: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor:
    """``tensor`` itself in the forward; its gradient averaged over ``tp_group`` in the backward (the input of
    a folded layer, whose lanes each see ``tp`` times their own assignments' gradient)."""
    if tp_size <= 1 or not dist.is_initialized() or not tensor.requires_grad:
        return tensor
    return _AverageOverTP.apply(tensor, tp_group)
