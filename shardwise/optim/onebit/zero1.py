"""1-bit Adam at ZeRO stage 1: the optimizer state partitioned, the exchange exactly stage 0's.

At stage 1 each rank keeps the momentum, the variance (and, with fp16/bf16, the fp32 master
weights) of its own 1/N of the parameters, and the whole local gradient. During warm-up nothing
changes: the gradients are reduced at the boundary and AdamW steps this rank's fragments.

After warm-up the gradients stay local (``reduce_gradients`` False) and the compressed stage 1
strategy (``zero/compressed.py``) hands the step to :class:`Zero1Exchange`, which runs the same
arithmetic as OneBitAdam at stage 0, operation for operation, so the two give the same weights bit
for bit:

* the full momentum of the last step is ``update x denominator``, both full: the update is the
  decompressed exchange result (kept in the exchange buffer), the denominator is the frozen one;
  at the first compressed step, and after a checkpoint load, the momentum and the frozen variance
  are assembled once from every rank's fragments (one full-precision all-reduce each);
* each rank folds its local gradient in, divides by the denominator and sends the result through
  the 1-bit compressed all-reduce in stage 0's tensor order and chunking;
* every rank then holds the whole averaged update. It writes its own fragments' momentum (the
  only momentum kept between steps) and moves the weights: fp32 weights everywhere at once, with
  no parameter all-gather; with fp16/bf16 its fp32 master fragments (the strategy then writes them
  back and all-gathers the 16-bit weights, as in any stage 1 step).

Memory per element, besides the exchange buffers stage 0 also has (the worker error and the update):
the frozen denominator (4 bytes) and a 1-byte mask of never-seen elements, instead of stage 0's
full momentum and variance (8 bytes): the partitioned momentum and variance cost 8/N bytes.
"""

from __future__ import annotations

import logging
import math

import torch

from shardwise import comm
from shardwise.precision import apply_coefficient_

logger = logging.getLogger("shardwise")


class _Item:
    """One parameter as stage 0 would step it: its full local gradient, its model weight, and the
    fragments (of this rank's optimizer tensors) that hold pieces of it."""

    __slots__ = ("group", "param", "flat_group", "offset", "frags", "start", "numel")

    def __init__(self, group, param, flat_group, offset, frags, start):
        self.group, self.param, self.frags, self.start = group, param, frags, start
        self.flat_group, self.offset = flat_group, offset  # where its gradient lies in the gradient buffers
        self.numel = param.numel()


class Zero1Exchange:
    """OneBitAdam's compressed step on a ZeRO stage 1 strategy (see the module docstring)."""

    def __init__(self, optimizer, *, groups, fragments, dp_group, order: list[list[int]],
                 separate_master: bool) -> None:
        """The strategy's layout: ``groups`` (its flat groups: parameters, names, offsets), ``fragments``
        (per group, this rank's optimizer fragments), ``dp_group``; ``order``: per param group, the ids of
        the model parameters as the optimizer was built with them (stage 0's order), taken before the
        strategy replaced them by fragments; ``separate_master``: the fragments are fp32 copies (16-bit
        training), written back by the strategy after the step."""
        self.optimizer = optimizer
        self.dp_group = dp_group
        self.separate_master = separate_master
        where = {id(p): (gi, i) for gi, g in enumerate(groups) for i, p in enumerate(g.params)}
        frags_of: dict[str, list] = {}
        for frags in fragments:
            for f in frags:
                frags_of.setdefault(f.name, []).append(f)
        self.items: list[_Item] = []
        start = 0
        for group, ids in zip(optimizer.param_groups, order):
            for pid in ids:
                if pid not in where:  # frozen: no gradient, stage 0 skips it too
                    continue
                gi, i = where[pid]
                g = groups[gi]
                item = _Item(group, g.params[i], gi, g.offsets[i], frags_of.get(g.names[i], []), start)
                self.items.append(item)
                start += item.numel
        self.sizes = [it.numel for it in self.items]
        self.total = start
        owned = torch.tensor([float(sum(len(it.frags) for it in self.items) > 0)])
        comm.all_reduce(owned, op=comm.ReduceOp.MIN, group=dp_group)
        if owned.item() == 0:
            raise ValueError("OneBitAdam at zero_optimization.stage 1: a rank owns no piece of any parameter "
                             "(the model is too small for this many ranks); use zero_optimization.stage 0")
        self.stale()
        optimizer.use_partitioned_exchange(self)

    def stale(self) -> None:
        """Forget the full frozen denominator and the update: rebuild them from the fragments next step
        (first compressed step; after a checkpoint load)."""
        self.denominator: torch.Tensor | None = None
        self.unseen: torch.Tensor | None = None
        self.have_update = False

    # -- assembling full tensors from every rank's fragments -----------------------------------------
    def _assemble(self, what: str) -> torch.Tensor:
        """The optimizer state ``what`` of every parameter, full, in stage 0's order (one all-reduce)."""
        device = self.items[0].param.device
        out = torch.zeros(self.total, dtype=torch.float32, device=device)
        for it in self.items:
            for f in it.frags:
                src = self.optimizer.state[f.tensor][what]
                out[it.start + f.param_start : it.start + f.param_end] = src.reshape(-1)
        comm.all_reduce(out, group=self.dp_group)
        return out

    def _freeze(self, bc2_of) -> None:
        v = self._assemble("exp_avg_sq")
        self.denominator = torch.empty_like(v)
        for it in self.items:
            piece = slice(it.start, it.start + it.numel)
            self.denominator[piece] = (v[piece].sqrt() / math.sqrt(bc2_of(it.group))).add_(it.group["eps"])
        self.unseen = v == 0

    # -- the step --------------------------------------------------------------------------------------
    def step(self, grads: list[torch.Tensor], *, coef: float) -> None:
        """One compressed step from this rank's whole local gradients ``grads`` (the strategy's flat
        gradient buffers), multiplied by ``coef`` (unscale x clip) first."""
        opt = self.optimizer
        if grads[0].dtype != torch.float32:
            grads = [g.to(torch.float32) for g in grads]
        apply_coefficient_(grads, coef)

        t = opt._steps_done() + 1
        if self.denominator is None:
            freeze = opt.freeze_step

            def bc2_of(group):
                return 1 - group["betas"][1] ** min(t, freeze) if opt.bias_correction else 1.0

            self._freeze(bc2_of)
            if t == freeze + 1:
                logger.info("OneBitAdam (ZeRO stage 1): step %d: variance frozen, momentum now exchanged with "
                            "1-bit compression", t)
        momentum = None if self.have_update else self._assemble("exp_avg")

        flat = opt._flat("momentum", self.total, self.denominator.device)
        for it in self.items:
            piece = slice(it.start, it.start + it.numel)
            beta1 = it.group["betas"][0]
            d = self.denominator[piece]
            m = momentum[piece] if momentum is not None else torch.mul(flat[piece], d)
            m.mul_(beta1).add_(grads[it.flat_group][it.offset : it.offset + it.numel], alpha=1 - beta1)
            torch.div(m, d, out=flat[piece])
        opt._exchange_flat("momentum", flat, self.sizes)
        flat.masked_fill_(self.unseen, 0.0)
        self.have_update = True

        separate = self.separate_master
        for it in self.items:
            lr, wd = it.group["lr"], it.group["weight_decay"]
            bc1 = 1 - it.group["betas"][0] ** t if opt.bias_correction else 1.0
            update = flat[it.start : it.start + it.numel]
            for f in it.frags:
                st = opt.state[f.tensor]
                st["step"] += 1
                torch.mul(update[f.param_start : f.param_end], self.denominator[it.start + f.param_start :
                          it.start + f.param_end], out=st["exp_avg"].view(-1))
                if separate:  # the fp32 master fragment; the 16-bit weights are all-gathered below
                    w = f.tensor.detach()
                    if wd != 0:
                        w.mul_(1 - lr * wd)
                    w.add_(update[f.param_start : f.param_end].view_as(w), alpha=-lr / bc1)
            if not separate:  # fp32: every rank moves the whole weight by the same update
                w = it.param.detach()
                if wd != 0:
                    w.mul_(1 - lr * wd)
                w.add_(update.view_as(w), alpha=-lr / bc1)
