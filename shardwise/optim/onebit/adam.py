"""1-bit Adam (Tang et al., 2021, arXiv:2102.02888), DeepSpeed's ``OneBitAdam`` config type.

Steps ``1 .. freeze_step`` (warm-up) are plain AdamW with the engine's full-precision gradient
all-reduce: this class *is* ``torch.optim.AdamW`` then, so the losses equal type ``Adam``'s bit
for bit. From step ``freeze_step + 1`` on:

* the variance ``v`` stays as it was after warm-up (frozen);
* each rank folds its own, un-reduced gradient into the momentum ``m``;
* the momenta are averaged with the 1-bit compressed all-reduce (signs plus one scale per
  chunk, error feedback on the worker and the server side: ``shardwise.comm.compressed``);
* the weights move by ``lr * m_hat / (sqrt(v_hat) + eps)`` plus decoupled weight decay.

Differences from DeepSpeed, on purpose: DeepSpeed accepts ``bias_correction`` and ignores it (its
1-bit Adam never corrects); here ``bias_correction: true`` (the default) corrects as AdamW does,
the frozen variance with its factor at the freeze, so warm-up *is* Adam. ``bias_correction:
false`` gives DeepSpeed's formula ``m / (sqrt(v) + eps) + weight_decay * p``. DeepSpeed's first
``step()`` only sets up its cupy buffers and leaves the weights alone; here it is a real step.
The worker scale is one per chunk (DeepSpeed: one per tensor), and all parameters travel in one
flat buffer (two collectives per step, not two per parameter).
"""

from __future__ import annotations

import logging
import math

import torch

from shardwise.optim.onebit.common import CompressedComm, check_common_args, check_positive_int

logger = logging.getLogger("shardwise")


def _implementation(params) -> dict:
    """The same kernel choice the optimizer factory makes for type ``Adam`` (so warm-up is bitwise Adam):
    torch's fused AdamW on one CPU/CUDA device with floating-point tensors, else the foreach path."""
    tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
    tensors = [t[1] if isinstance(t, tuple) else t for t in tensors]
    devices = {t.device.type for t in tensors if isinstance(t, torch.Tensor)}
    if tensors and len(devices) == 1 and devices <= {"cpu", "cuda"} and all(
            isinstance(t, torch.Tensor) and t.is_floating_point() for t in tensors):
        return {"fused": True}
    return {"foreach": True}


class OneBitAdam(CompressedComm, torch.optim.AdamW):
    """1-bit Adam: AdamW during warm-up, then frozen variance and 1-bit compressed momentum."""

    supports_zero1 = True  # at ZeRO stage 1 the compressed step is optim/onebit/zero1.py (zero/compressed.py)

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str | None = None,
    ) -> None:
        check_common_args(amsgrad=amsgrad, cuda_aware=cuda_aware, name="OneBitAdam")
        if eps_inside_sqrt:
            raise ValueError("eps_inside_sqrt: true is not supported by OneBitAdam "
                             "(DeepSpeed accepts it and ignores it); remove it")
        self.freeze_step = check_positive_int(freeze_step, "freeze_step")
        self.bias_correction = bool(bias_correction)
        params = list(params)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         **_implementation(params))
        self._init_comm(comm_backend_name, cuda_aware)

    # -- phase ------------------------------------------------------------------------------------
    @property
    def frozen(self) -> bool:
        """True once warm-up is over (the momentum is exchanged compressed)."""
        return self._steps_done() >= self.freeze_step

    @property
    def needs_gradient_allreduce(self) -> bool:
        return self._steps_done() + 1 <= self.freeze_step

    def _frozen_denominator(self, p, st, bc2: float, eps: float) -> torch.Tensor:
        """``sqrt(v_hat) + eps`` of the frozen variance, computed once (not saved: rebuilt after a load),
        remembering where ``v`` is exactly zero (see ``mask_unseen``)."""
        cache = self.__dict__.setdefault("_denoms", {})
        found = cache.get(p)
        if found is None or found[1] is not st["exp_avg_sq"]:
            v = st["exp_avg_sq"]
            denom = (v.sqrt() / math.sqrt(bc2)).add_(eps)
            cache[p] = found = (denom, v)
            self.__dict__.setdefault("_unseen", {})[p] = v == 0
        return found[0]

    # -- step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self._steps_done() + 1
        if t <= self.freeze_step:
            if self.bias_correction:
                super().step()
            else:
                self._manual_step(t, compressed=False)
        else:
            if self.partitioned_exchange is not None:
                raise RuntimeError("OneBitAdam at ZeRO stage 1: after warm-up the step runs through engine.step() "
                                   "(the strategy hands it the local gradients), not optimizer.step()")
            if t == self.freeze_step + 1 and self.world_size > 1:
                logger.info("OneBitAdam: step %d: variance frozen, momentum now exchanged with 1-bit compression", t)
            self._manual_step(t, compressed=True)
        return loss

    def _states(self, group):
        """(param, state) of the tensors with a gradient (the same on every rank at ZeRO stage 0)."""
        out = []
        for p in group["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out.append((p, st))
        return out

    def _manual_step(self, t: int, *, compressed: bool) -> None:
        """DeepSpeed's update; ``compressed``: frozen variance, local gradient, momentum exchanged.

        What travels is the momentum divided by the (frozen, identical on every rank) Adam
        denominator, i.e. the update itself: averaging commutes with that fixed scaling, and the
        1-bit error is then relative to each element's step rather than to the largest momenta of
        its tensor (with ``m`` itself, an element with a small variance gets ``+-rms(m) / sqrt(v)``,
        far larger than any step Adam would take, and training can blow up)."""
        groups = [(g, self._states(g)) for g in self.param_groups]
        for group, states in groups:
            beta1, beta2 = group["betas"]
            for p, st in states:
                grad = p.grad
                st["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                if not compressed:
                    st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        items = []
        for group, states in groups:
            beta1, beta2 = group["betas"]
            bc1, bc2 = 1.0, 1.0
            if self.bias_correction:
                bc1 = 1 - beta1**t
                bc2 = 1 - beta2 ** min(t, self.freeze_step)  # the variance stopped at the freeze
            for p, st in states:
                items.append((group, p, st, bc1, bc2))
        exchange = compressed and self.world_size > 1 and bool(items)
        if exchange:  # the updates are written straight into the exchange buffer
            sizes = [p.numel() for _, p, _, _, _ in items]
            flat = self._flat("momentum", sum(sizes), items[0][1].device)
            updates = [piece.view(p.shape) for piece, (_, p, _, _, _) in zip(flat.split(sizes), items)]
        denoms = []
        for i, (group, p, st, _, bc2) in enumerate(items):
            if compressed:
                denoms.append(self._frozen_denominator(p, st, bc2, group["eps"]))
            else:
                denoms.append((st["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(group["eps"]))
            if exchange:
                torch.div(st["exp_avg"], denoms[i], out=updates[i])
        if exchange:
            self._exchange_flat("momentum", flat, sizes)
        else:
            updates = [st["exp_avg"] / d for (_, _, st, _, _), d in zip(items, denoms)]
        for (group, p, st, bc1, _), denom, update in zip(items, denoms, updates):
            lr, wd = group["lr"], group["weight_decay"]
            st["step"] += 1
            if compressed:
                update.masked_fill_(self._unseen[p], 0.0)
                torch.mul(update, denom, out=st["exp_avg"])  # every rank now holds the averaged momentum
            if wd != 0:
                p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr / bc1)
