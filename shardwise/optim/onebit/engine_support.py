"""What the engine does for an optimizer with ``compressed_communication`` (1-bit Adam, 0/1 Adam, 1-bit LAMB).

* :func:`attach` at ``initialize``: refuse the combinations that cannot work, with the reason, and
  give the optimizer the data-parallel group; :func:`bind_strategy` once the ZeRO strategy exists
  (stage 1: the strategy hands the compressed step to ``optim/onebit/zero1.py``).
* Before each backward the engine sets ``engine.enable_backward_allreduce`` to
  ``optimizer.needs_gradient_allreduce``; when it is False the gradients stay local (the optimizer
  exchanges compressed momentum itself), as in DeepSpeed, where the optimizer clears that switch.
* :func:`agree_on_overflow` before such a step: with local gradients one rank may see an inf/nan the
  others do not; it would skip the step (and the exchange) alone and the others would wait for it
  forever. One small all-reduce makes every rank skip together.
"""

from __future__ import annotations

import torch

from shardwise import comm

_WHY = ("{name} averages the momentum of whole, replicated tensors with its own compressed exchange "
        "(DeepSpeed supports it at ZeRO stage 0 only)")


_STAGE1_WHY = {
    "ZeroOneAdam": "ZeroOneAdam's local steps move every rank's own copy of the whole momentum and weights "
                   "apart between synchronisations; at stage 1 a rank keeps only 1/N of the momentum",
    "OneBitLamb": "OneBitLamb's trust ratios need the norms of whole tensors of weights, momentum and fresh "
                  "variance every step; at stage 1 they are cut across ranks (not implemented)",
}


def attach(optimizer, *, dp_group, zero_stage: int, offload: bool = False, pipeline_stages: int = 1) -> None:
    """Check the engine's configuration for ``optimizer`` and bind it to ``dp_group``."""
    name = type(optimizer).__name__
    why = _WHY.format(name=name)
    if zero_stage == 1 and not getattr(optimizer, "supports_zero1", False):
        raise ValueError(
            f"optimizer.type={name} with zero_optimization.stage=1: not supported. {_STAGE1_WHY.get(name, why)}. "
            "Use zero_optimization.stage 0 (OneBitAdam also runs at stage 1)"
        )
    if zero_stage == 2:
        raise ValueError(
            f"optimizer.type={name} with zero_optimization.stage=2: not supported. {why}; at stage 2 each rank "
            "keeps only its 1/N share of the gradients, reduce-scattered during backward, so there is no whole "
            "local gradient to compress. Use zero_optimization.stage 0"
            + (" or 1" if getattr(optimizer, "supports_zero1", False) else "")
        )
    if zero_stage == 3:
        raise ValueError(
            f"optimizer.type={name} with zero_optimization.stage=3: not supported. {why}; at stage 3 the "
            "parameters themselves are partitioned. Use zero_optimization.stage 0"
        )
    if offload:
        raise ValueError(f"optimizer.type={name} with zero_optimization.offload_optimizer: not supported. {why}; "
                         "offload needs ZeRO stage 1-3")
    if pipeline_stages > 1:
        raise ValueError(
            f"optimizer.type={name} with {pipeline_stages} pipeline stages: not supported: the pipeline engine's "
            "gradient reduction cannot yet be handed over to the optimizer (DeepSpeed's "
            "pipeline_enable_backward_allreduce). Train without pipeline parallelism"
        )
    optimizer.bind_group(dp_group)
    if zero_stage == 1:  # stage 0's parameter order, before the strategy replaces them by fragments
        optimizer._zero1_order = [[id(p) for p in g["params"]] for g in optimizer.param_groups]


def bind_strategy(optimizer, strategy) -> None:
    """After the ZeRO strategy is built: at stage 1, let it hand the compressed step to the optimizer."""
    if getattr(strategy, "stage", 0) != 1:
        return
    from shardwise.optim.onebit.zero1 import Zero1Exchange

    exchange = Zero1Exchange(optimizer, strategy, optimizer._zero1_order)
    optimizer._zero1 = exchange
    strategy.local_step = exchange


def agree_on_overflow(module: torch.nn.Module, dp_group) -> None:
    """If any rank's local gradients hold an inf/nan, put a nan in every rank's (so all skip the step)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads or comm.get_world_size(dp_group) == 1:
        return
    bad = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
    for g in grads:
        if not bool(torch.isfinite(g).all()):
            bad.fill_(1.0)
            break
    comm.all_reduce(bad, op=comm.ReduceOp.MAX, group=dp_group)
    if bool(bad.item()):
        grads[0].view(-1)[0] = float("nan")
