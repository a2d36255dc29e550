"""Cross-entropy over logits cut along the vocabulary: no rank ever holds the full logits.

Each rank has ``logits[..., v0:v1]``. The loss needs the maximum (for stability), the sum of
exponentials and the target's logit over the whole vocabulary: three all-reduces of
``[batch, seq]``-sized tensors over the tensor group, never of the ``[batch, seq, vocab]`` logits.
The gradient ``softmax - one_hot(target)`` is then local to each rank's slice.
"""

from __future__ import annotations

import torch

from shardwise import comm
from shardwise.topology import TENSOR_AXIS, tensor_parallel_group_and_size

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, size, ignore_index):
        logits = logits.float()
        per = logits.shape[-1]
        start = comm.get_rank(group) * per if size > 1 else 0
        logits_max = logits.max(dim=-1).values
        if size > 1:
            comm.all_reduce(logits_max, op=comm.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)
        ignored = target == ignore_index
        outside = (target < start) | (target >= start + per) | ignored
        local = (target - start).masked_fill(outside, 0)
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if size > 1:
            both = torch.stack([picked, sum_exp])
            comm.all_reduce(both, group=group)
            picked, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - picked).masked_fill(ignored, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside, ignored = ctx.saved_tensors
        grad = softmax
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local.unsqueeze(-1), -hit.unsqueeze(-1))
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, label_smoothing=0.0,
                                 *, group=TENSOR_AXIS, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss (no reduction, as Megatron's), the same on every tensor rank; tokens whose
    target is ``ignore_index`` get 0 loss and 0 gradient. The logits are this rank's vocabulary
    slice (e.g. a ``ColumnParallelLinear(gather_output=False)`` output); they are upcast to fp32."""
    if label_smoothing:
        raise ValueError("vocab_parallel_cross_entropy: label_smoothing is not implemented")
    group, size = tensor_parallel_group_and_size(group)
    return _VocabParallelCE.apply(vocab_parallel_logits, target, group, size, ignore_index)
