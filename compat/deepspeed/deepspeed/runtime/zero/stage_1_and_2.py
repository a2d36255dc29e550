"""``deepspeed.runtime.zero.stage_1_and_2``: ``DeepSpeedZeroOptimizer`` and ``IPGBucket``.

shardwise's engine keeps the torch optimizer (``engine.optimizer``) and runs ZeRO-1/2 as a strategy beside it,
so ``deepspeed.initialize`` never builds a ``DeepSpeedZeroOptimizer`` and constructing one refuses with the
reason. The class still carries DeepSpeed's small bucket and gradient-hook helpers, which read only attributes
of their own instance and the helpers it is given, for code that drives them on an instance it set up itself:

* ``allreduce_and_copy`` / ``allreduce_and_copy_with_multiple_ranks``: reduce a bucket with the instance's
  ``allreduce_bucket``, copy the results (split by the instance's ``unflatten``) back into the bucket's
  tensors on the ranks that consume them, and, when communication overlaps (``overlap_comm``) on an
  accelerator that does not order streams by itself, record the reduction stream on every tensor the
  reduction stream wrote or read, so their memory is not reused too early;
* ``_maybe_reduce_autoep_folding_tp_gradient``: the AutoEP+AutoTP folding correction of a gradient in a
  gradient hook, which ZeRO-2 (partitioned gradients) and overlapped ZeRO-1 apply there and non-overlapped
  ZeRO-1 leaves to the engine's sweep at the accumulation boundary;
* ``IPGBucket``: the independent-partition gradient bucket, with the streams that copied into it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

import torch

from deepspeed import comm as dist
from deepspeed.accelerator import get_accelerator


def apply_folding_correction_to_grad_buffer(*args, **kwargs):
    """DeepSpeed's folding correction (deepspeed.module_inject.auto_ep_folding), looked up when first used."""
    from deepspeed.module_inject import auto_ep_folding

    return auto_ep_folding.apply_folding_correction_to_grad_buffer(*args, **kwargs)


@dataclass
class IPGBucket:
    """Gradients gathered for one reduction: the buffers, the parameters and gradients in it, its element count
    and fill index, whether it holds MoE parameters, and the streams that copied into the current buffer."""

    buffer: List[torch.Tensor] = field(default_factory=list)
    params: List[torch.Tensor] = field(default_factory=list)
    grads: List[torch.Tensor] = field(default_factory=list)
    elements: int = 0
    index: int = 0
    has_moe_params: bool = False
    copy_streams: set = field(default_factory=set)

    def clear(self) -> None:
        """Empty the bucket for its next fill (the buffers stay)."""
        self.params.clear()
        self.grads.clear()
        self.elements = 0
        self.has_moe_params = False
        self.copy_streams.clear()


class DeepSpeedZeroOptimizer:
    """DeepSpeed's ZeRO-1/2 optimizer class (see the module: shardwise never builds one; its helpers work on an
    instance set up by the caller)."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            f"{__name__}.DeepSpeedZeroOptimizer is not provided by shardwise: ZeRO-1/2 is a strategy of the engine "
            "(zero_optimization.stage); engine.optimizer is the torch optimizer. See docs/deepspeed-compat.md")

    def _must_record_streams(self) -> bool:
        return bool(self.overlap_comm) and not get_accelerator().resolves_data_dependency()

    def clear_grad_attribute(self, param) -> None:
        if getattr(self, "use_grad_accum_attribute", False):
            param.grad_accum = None
        else:
            param.grad = None

    def _clear_previous_reduced_grads(self) -> None:
        for reduced in self.previous_reduced_grads.values():
            for param in reduced:
                self.clear_grad_attribute(param)
            reduced.clear()

    def allreduce_and_copy(self, small_bucket, communication_data_type: torch.dtype, rank=None, log=None, divide=True,
                           process_group=None) -> None:
        """Reduce ``small_bucket`` (to ``rank`` only, when given) and copy the result back into its tensors on
        the rank(s) that receive it; with ``overlap_comm`` this runs on the reduction stream, after the
        gradients of the previous reduction are dropped."""
        process_group = self.dp_process_group if process_group is None else process_group
        accelerator = get_accelerator()
        if self.overlap_comm:
            if not accelerator.resolves_data_dependency():
                accelerator.synchronize()
            self._clear_previous_reduced_grads()  # the earlier reduction has finished with them
            stream = self.reduction_stream
        else:
            stream = accelerator.current_stream()
        with accelerator.stream(stream):
            reduced = self.allreduce_bucket(small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                                            process_group=process_group)
            record = self._must_record_streams()
            if record:
                reduced.record_stream(stream)
            if rank is not None and rank != dist.get_rank(group=self.dp_process_group):
                return
            for buf, synced in zip(small_bucket, self.unflatten(reduced, small_bucket)):
                buf.copy_(synced)
                if record:
                    buf.record_stream(stream)

    def allreduce_and_copy_with_multiple_ranks(self, small_bucket, communication_data_type: torch.dtype, log=None,
                                               divide=True, process_group=None, bucket_ranks=None) -> None:
        """Reduce ``small_bucket`` and copy each result only where this rank consumes it: ``bucket_ranks[i]`` is
        the rank (or a frozenset of the ranks) that uses tensor ``i``."""
        process_group = self.dp_process_group if process_group is None else process_group
        reduced = self.allreduce_bucket(small_bucket, communication_data_type, log=log, divide=divide,
                                        process_group=process_group)
        record = self._must_record_streams()
        if record:
            reduced.record_stream(self.reduction_stream)
        me = dist.get_rank(group=process_group)
        for buf, synced, consumer in zip(small_bucket, self.unflatten(reduced, small_bucket), bucket_ranks):
            if me in consumer if isinstance(consumer, frozenset) else me == consumer:
                buf.copy_(synced)
                if record:
                    buf.record_stream(self.reduction_stream)

    def configure_autoep_folding_tp_gradient_reduction(self, folding_spec) -> None:
        """Apply AutoEP+AutoTP folding corrections over the tensor-parallel group (none for ``tp_size`` <= 1)."""
        if folding_spec is None or folding_spec.tp_size <= 1:
            self.autoep_folding_tp_group = self.autoep_folding_spec = None
            return
        from deepspeed.utils import groups

        self.autoep_folding_tp_group = groups.get_tensor_model_parallel_group()
        self.autoep_folding_spec = folding_spec

    def _maybe_reduce_autoep_folding_tp_gradient(self, param, grad) -> None:
        """The folding correction of ``grad`` in the gradient hook: with partitioned gradients (ZeRO-2) or
        overlapped ZeRO-1, once the gradient is ready; non-overlapped ZeRO-1 leaves it to the engine's sweep.
        ZeRO-1 marks the parameter corrected so the sweep does not correct it again."""
        if not self.partition_gradients and not self.overlap_comm:
            return
        if self.autoep_folding_tp_group is None or grad is None or not getattr(param, "ds_grad_is_ready", True):
            return
        apply_folding_correction_to_grad_buffer(self.autoep_folding_spec, param, grad,
                                                tp_group=self.autoep_folding_tp_group,
                                                use_correction_marker=not self.partition_gradients)


__all__ = ["DeepSpeedZeroOptimizer", "IPGBucket"]
