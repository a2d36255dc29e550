"""0/1 Adam (Lu et al., 2022, arXiv:2202.06009), DeepSpeed's ``ZeroOneAdam`` config type.

Two ideas on top of 1-bit Adam, with DeepSpeed's schedule:

* **the variance is updated less and less often**: at steps that are multiples of
  ``var_interval`` the engine all-reduces gradients in full precision and both moments are
  updated (plain Adam); at the other steps each rank's gradient is averaged with the 1-bit
  compressed all-reduce and only the momentum moves. After ``var_update_scaler`` variance
  updates the interval doubles. The first ``var_update_scaler`` steps are therefore plain AdamW,
  bit for bit (this class is ``torch.optim.AdamW`` for them);
* **after ``var_freeze_step`` the ranks take local steps**: each rank steps on its own gradients
  and accumulates its updates; every ``local_step_interval`` steps the accumulated updates are
  averaged (1-bit compressed), each rank rolls back its own and applies the average, and the
  momentum is rebuilt from it. The interval doubles every ``local_step_scaler`` steps, up to
  ``local_step_clipper``. Between synchronisations the replicas differ, by design.

Differences from DeepSpeed, on purpose: ``bias_correction: true`` (the default) corrects the
momentum by ``1 - beta1^t`` and the variance by ``1 - beta2^k`` (k = the number of variance
updates so far), so the first steps equal AdamW's; ``false`` gives DeepSpeed's uncorrected
formula. DeepSpeed's first ``step()`` only sets up buffers; here it is a real step.
"""

from __future__ import annotations

import logging
import math

import torch

from shardwise.optim.onebit.adam import _implementation
from shardwise.optim.onebit.common import CompressedComm, check_common_args, check_positive_int, mask_unseen

logger = logging.getLogger("shardwise")

_COUNTERS = ("var_interval", "var_counter", "var_updates", "local_step_interval", "local_step_counter")


class ZeroOneAdam(CompressedComm, torch.optim.AdamW):
    """0/1 Adam: adaptive variance freezing and 1-bit synchronisation of local steps."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str | None = None,
    ) -> None:
        check_common_args(amsgrad=amsgrad, cuda_aware=cuda_aware, name="ZeroOneAdam")
        if eps_inside_sqrt:
            raise ValueError("eps_inside_sqrt: true is not supported by ZeroOneAdam "
                             "(DeepSpeed accepts it and ignores it); remove it")
        self.var_freeze_step = check_positive_int(var_freeze_step, "var_freeze_step", minimum=0)
        self.var_update_scaler = check_positive_int(var_update_scaler, "var_update_scaler")
        self.local_step_scaler = check_positive_int(local_step_scaler, "local_step_scaler")
        self.local_step_clipper = check_positive_int(local_step_clipper, "local_step_clipper")
        self.bias_correction = bool(bias_correction)
        params = list(params)
        super().__init__(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         **_implementation(params))
        self._init_comm(comm_backend_name, cuda_aware)

    # -- counters (kept in every tensor's state, as DeepSpeed does, so checkpoints carry them) --
    def _first_state(self) -> dict:
        """The state of a tensor stepped as often as any (its counters are current)."""
        done = self._steps_done()
        for st in self.state.values():
            if "step" in st and int(st["step"]) == done:
                return st
        return {}

    def _counter(self, name: str) -> int:
        st = self._first_state()
        if name in st:
            return int(st[name])
        return 1 if name in ("var_interval", "local_step_interval") else 0

    def _set_counter(self, name: str, value: int) -> None:
        for p in self._all_params():
            st = self.state.get(p)
            if not st or "step" not in st:
                continue  # a tensor the optimizer never stepped (no gradient yet)
            if name in st:
                st[name].fill_(value)
            else:
                st[name] = torch.tensor(value, dtype=torch.int64)

    def _frozen_at(self, t: int) -> bool:
        """Step ``t`` takes local steps (DeepSpeed freezes after the step that exceeds var_freeze_step)."""
        return t - 1 > self.var_freeze_step

    @property
    def frozen(self) -> bool:
        return self._frozen_at(self._steps_done() + 1)

    @property
    def needs_gradient_allreduce(self) -> bool:
        t = self._steps_done() + 1
        return not self._frozen_at(t) and t % self._counter("var_interval") == 0

    # -- step ---------------------------------------------------------------------------------------
    def _states(self):
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if "exp_avg" not in st:
                    st["step"] = torch.tensor(float(self._steps_done()), dtype=torch.float32)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                out.append((group, p, st))
        return out

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self._steps_done() + 1
        counters = {name: self._counter(name) for name in _COUNTERS}
        if self._frozen_at(t):
            if not self._frozen_at(t - 1):
                self._errors.pop("grad", None)  # 1-bit gradients are over; the accumulator gets fresh buffers
                if self.world_size > 1:
                    logger.info("ZeroOneAdam: step %d: variance frozen, local steps synchronised with 1-bit "
                                "compression from now on", t)
            self._local_step(t, counters)
        else:
            self._variance_phase_step(t, counters)
        for name, value in counters.items():
            self._set_counter(name, value)
        return loss

    def _variance_phase_step(self, t: int, c: dict) -> None:
        var_step = t % c["var_interval"] == 0
        if var_step and c["var_updates"] == t - 1 and self.bias_correction:
            super().step()  # every step so far updated the variance: exactly AdamW
        else:
            items = self._states()
            if var_step:
                for group, p, st in items:
                    beta1, beta2 = group["betas"]
                    grad = p.grad
                    st["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                    st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            else:
                grads = [p.grad.clone() for _, p, _ in items]
                self._exchange("grad", grads)
                mask_unseen([(grad, st["exp_avg_sq"]) for (_, _, st), grad in zip(items, grads)])
                for (group, p, st), grad in zip(items, grads):
                    beta1 = group["betas"][0]
                    st["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
            k = c["var_updates"] + (1 if var_step else 0)
            for group, p, st in items:
                st["step"] += 1
                update = self._update(group, p, st, t, k)
                p.add_(update, alpha=-group["lr"])
        if var_step:
            c["var_updates"] += 1
            c["var_counter"] += 1
            if c["var_counter"] == self.var_update_scaler:
                c["var_counter"] = 0
                c["var_interval"] *= 2

    def _denom(self, group, st, k: int) -> torch.Tensor:
        bc2 = 1 - group["betas"][1] ** max(k, 1) if self.bias_correction else 1.0
        return (st["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(group["eps"])

    def _update(self, group, p, st, t: int, k: int) -> torch.Tensor:
        """``m_hat / (sqrt(v_hat) + eps) + weight_decay * p`` (DeepSpeed's update, bias-corrected)."""
        bc1 = 1 - group["betas"][0] ** t if self.bias_correction else 1.0
        update = (st["exp_avg"] / bc1).div_(self._denom(group, st, k))
        if group["weight_decay"] > 0:
            update.add_(p, alpha=group["weight_decay"])
        return update

    def _local_step(self, t: int, c: dict) -> None:
        items = self._states()
        k = c["var_updates"]
        for group, p, st in items:
            if "momentum_accumulator" not in st:
                st["momentum_accumulator"] = torch.zeros_like(p)
                st["lrs"] = torch.tensor(0.0, dtype=torch.float64)
            beta1 = group["betas"][0]
            st["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
            st["lrs"] += group["lr"]
            st["step"] += 1
            update = self._update(group, p, st, t, k)
            p.add_(update, alpha=-group["lr"])
            st["momentum_accumulator"].add_(update, alpha=-group["lr"])
        if t % c["local_step_interval"] == 0:
            accs = []
            for group, p, st in items:
                acc = st["momentum_accumulator"]
                p.sub_(acc)  # back to where the ranks last agreed
                acc.mul_(self._denom(group, st, k))
                accs.append(acc)
            self._exchange("accumulator", accs)
            mask_unseen([(st["momentum_accumulator"], st["exp_avg_sq"]) for _, _, st in items])
            for group, p, st in items:
                acc = st["momentum_accumulator"]
                bc1 = 1 - group["betas"][0] ** t if self.bias_correction else 1.0
                st["exp_avg"].copy_(acc).div_(-float(st["lrs"])).mul_(bc1)
                p.add_(acc / self._denom(group, st, k))
                acc.zero_()
                st["lrs"].zero_()
        c["local_step_counter"] += 1
        if c["local_step_counter"] == self.local_step_scaler:
            c["local_step_counter"] = 0
            c["local_step_interval"] = min(self.local_step_clipper, c["local_step_interval"] * 2)

    # -- per-rank state: in the local-step phase momentum, accumulator and weights differ by rank --
    def rank_state_dict(self) -> dict[str, torch.Tensor]:
        out = super().rank_state_dict()
        if self._frozen_at(self._steps_done()):  # the last step was a local one
            for i, p in enumerate(self._all_params()):
                st = self.state.get(p, {})
                out[f"param/{i}"] = p.detach()
                for key in ("exp_avg", "momentum_accumulator"):
                    if key in st:
                        out[f"{key}/{i}"] = st[key]
        return out

    def load_rank_state_dict(self, tensors: dict[str, torch.Tensor] | None) -> None:
        tensors = tensors or {}
        super().load_rank_state_dict({k: v for k, v in tensors.items() if "/" not in k})
        params = self._all_params()
        with torch.no_grad():
            for name, value in tensors.items():
                if "/" not in name:
                    continue
                key, i = name.rsplit("/", 1)
                p = params[int(i)]
                if key == "param":
                    p.copy_(value.view(p.shape))
                else:
                    self.state[p][key] = value.view(p.shape).clone().to(p.device)
