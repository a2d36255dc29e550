"""1-bit LAMB (Li et al., 2021, arXiv:2104.06069), DeepSpeed's ``OneBitLamb`` config type.

Steps ``1 .. freeze_step`` (warm-up) are shardwise's ``Lamb`` with the engine's full-precision
gradient all-reduce (this class is a ``Lamb`` then, so the losses equal type ``Lamb``'s bit for
bit), while an exponential moving average (``coeff_beta``) of each tensor's trust ratio is kept.
At step ``freeze_step`` the variance is frozen and a copy (``exp_avg_sq_fresh``) goes on being
updated from the exchanged momentum. After warm-up, as DeepSpeed does:

* every tensor's momentum is scaled to a common magnitude (``scaling_coeff``, fixed at the first
  compressed step), so one flat buffer compresses well, and exchanged with the 1-bit compressed
  all-reduce (error feedback on both sides, ``shardwise.comm.compressed``);
* the gradient is reconstructed from two consecutive momenta and updates the fresh variance;
* the trust ratio is the frozen average times a factor ``max(denom_frozen / denom_fresh)``,
  clipped to ``[factor_min, factor_max]`` and to ``factor_threshold`` relative change per step.

Difference from DeepSpeed, on purpose: DeepSpeed's 1-bit LAMB ignores ``bias_correction``;
here ``true`` (the default) folds it into the step size as ``Lamb`` does (the frozen variance with
its factor at the freeze), compares the frozen and the fresh variance each corrected for its own
number of terms, and corrects the trust-ratio average for its start from 0 (``1 - coeff_beta**n``);
``false`` gives DeepSpeed's numbers. Uncorrected, a short warm-up shrinks every later step: the
fresh variance outgrows the frozen one by its own bias alone, and the average holds only
``1 - coeff_beta**freeze_step`` of the ratio (docs/onebit.md, "Convergence"). DeepSpeed's first
``step()`` leaves the weights alone (it sets up buffers); here it is a real step.
"""

from __future__ import annotations

import logging
import math

import torch

from shardwise.optim.lamb import Lamb
from shardwise.optim.onebit.common import CompressedComm, check_common_args, check_number, check_positive_int, \
    mask_unseen

logger = logging.getLogger("shardwise")


class OneBitLamb(CompressedComm, Lamb):
    """1-bit LAMB: LAMB during warm-up, then frozen variance and 1-bit compressed momentum."""

    # What ``bias_correction: true`` corrects after warm-up (docs/onebit.md, "Convergence"); each switch
    # undoes one correction (benchmarks/onebit_convergence.py measures them).
    _raw_coeff_average = False  # the trust-ratio average as an EMA started at 0 (DeepSpeed's)
    _raw_fresh_variance = False  # compare the frozen and fresh variances uncorrected (DeepSpeed's)
    _hold_factor = False  # (measurement only) factor 1: the frozen trust-ratio average alone

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
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str | None = None,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
    ) -> None:
        check_common_args(amsgrad=amsgrad, cuda_aware=cuda_aware, name="OneBitLamb")
        self.freeze_step = check_positive_int(freeze_step, "freeze_step")
        self.coeff_beta = check_number(coeff_beta, "coeff_beta")
        if self.coeff_beta >= 1:
            raise ValueError(f"coeff_beta: must be in [0, 1), got {coeff_beta!r}")
        self.factor_max = check_number(factor_max, "factor_max")
        self.factor_min = check_number(factor_min, "factor_min")
        if self.factor_min > self.factor_max:
            raise ValueError(f"factor_min: {factor_min} is above factor_max {factor_max}")
        self.factor_threshold = check_number(factor_threshold, "factor_threshold")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                         min_coeff=min_coeff)
        self._init_comm(comm_backend_name, cuda_aware)
        self._coeffs: list[float] = []

    @property
    def frozen(self) -> bool:
        return self._steps_done() >= self.freeze_step

    @property
    def needs_gradient_allreduce(self) -> bool:
        return self._steps_done() + 1 <= self.freeze_step

    def get_lamb_coeffs(self) -> list[float]:
        return list(self._coeffs)

    # -- step ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        t = self._steps_done() + 1
        if t <= self.freeze_step:
            self._warmup_step(t)
        else:
            if t == self.freeze_step + 1 and self.world_size > 1:
                logger.info("OneBitLamb: step %d: variance frozen, momentum now exchanged with 1-bit compression", t)
            self._compressed_step(t)
        return loss

    def _updated_in_order(self) -> list[torch.Tensor]:
        """The tensors ``Lamb.step`` updates, in the order of its trust ratios (by group, then by
        device and dtype in order of first appearance)."""
        order = []
        for group in self.param_groups:
            buckets: dict = {}
            for p in group["params"]:
                if p.grad is not None:
                    buckets.setdefault((p.device, p.dtype), []).append(p)
            for ps in buckets.values():
                order.extend(ps)
        return order

    def _warmup_step(self, t: int) -> None:
        updated = self._updated_in_order()
        Lamb.step(self)
        coeffs = Lamb.get_lamb_coeffs(self)
        assert len(coeffs) == len(updated), "Lamb reported one trust ratio per updated tensor"
        self._coeffs = coeffs
        for p, coeff in zip(updated, coeffs):
            st = self.state[p]
            if "lamb_coeff_freeze" not in st:
                st["lamb_coeff_freeze"] = torch.tensor(0.0, dtype=torch.float64)
                st["last_factor"] = torch.tensor(1.0, dtype=torch.float64)
                st["coeff_updates"] = torch.tensor(0.0, dtype=torch.float64)
            if coeff != 1.0:
                st["lamb_coeff_freeze"].mul_(self.coeff_beta).add_((1 - self.coeff_beta) * coeff)
                st["coeff_updates"] += 1
            if t == self.freeze_step:
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()

    def _compressed_step(self, t: int) -> None:
        params = [p for p in self._all_params() if p.grad is not None]
        for p in params:
            st = self.state[p]
            if "exp_avg_sq_fresh" not in st:  # a tensor that never had a gradient in warm-up
                st.setdefault("step", torch.tensor(float(t - 1), dtype=torch.float32))
                st.setdefault("exp_avg", torch.zeros_like(p))
                st.setdefault("exp_avg_sq", torch.zeros_like(p))
                st.setdefault("lamb_coeff_freeze", torch.tensor(0.0, dtype=torch.float64))
                st.setdefault("last_factor", torch.tensor(1.0, dtype=torch.float64))
                st.setdefault("coeff_updates", torch.tensor(0.0, dtype=torch.float64))
                st["exp_avg_sq_fresh"] = st["exp_avg_sq"].clone()
        if params and "scaling_coeff" not in self.state[params[0]]:
            rms = [float(self.state[p]["exp_avg"].norm() / math.sqrt(max(p.numel(), 1))) for p in params]
            united = sum(rms) / len(rms)
            for p, r in zip(params, rms):
                self.state[p]["scaling_coeff"] = torch.tensor(united / r if r > 0 else 1.0, dtype=torch.float64)

        last = {}
        momenta = []
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                m = st["exp_avg"]
                last[p] = m.clone()
                m.mul_(beta1).add_(p.grad, alpha=1 - beta1).mul_(float(st["scaling_coeff"]))
                momenta.append(m)
        self._exchange("momentum", momenta)
        mask_unseen([(self.state[p]["exp_avg"], self.state[p]["exp_avg_sq"]) for p in last])

        self._coeffs = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = float(group["lr"]), group["eps"], group["weight_decay"]
            step_size, corrected = lr, group["bias_correction"]
            if corrected:  # the update divides by the frozen variance: its correction is the freeze's
                step_size = lr * math.sqrt(1 - beta2**self.freeze_step) / (1 - beta1**t)
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["step"] += 1
                m, v, fresh = st["exp_avg"], st["exp_avg_sq"], st["exp_avg_sq_fresh"]
                m.div_(float(st["scaling_coeff"]))
                grad_rec = (m - last[p] * beta1) / (1 - beta1)
                fresh.mul_(beta2).addcmul_(grad_rec, grad_rec, value=1 - beta2)
                if group["eps_inside_sqrt"]:
                    denom, denom_real = (v + eps).sqrt(), (fresh + eps).sqrt()
                else:
                    denom, denom_real = v.sqrt().add_(eps), fresh.sqrt().add_(eps)
                prelim = m / denom
                update = prelim + wd * p if wd > 0 else prelim
                if corrected and not self._raw_fresh_variance:  # both as estimates of E[g^2]: the frozen
                    # variance holds freeze_step terms, the fresh one t; uncorrected, the fresh one
                    # outgrows the frozen one by its start from zero alone, not by any change in g
                    denom = (v / (1 - beta2**self.freeze_step)).sqrt_().add_(eps)
                    denom_real = (fresh / (1 - beta2**t)).sqrt_().add_(eps)
                factor = float((denom / denom_real).max())
                if wd > 0:
                    ratio = min(1.0, float(prelim.norm() / update.norm()))
                    factor = factor * ratio + (1.0 - ratio)
                factor = min(max(factor, self.factor_min), self.factor_max)
                last_factor = float(st["last_factor"])
                factor = min(max(factor, last_factor * (1.0 - self.factor_threshold)),
                             last_factor * (1.0 + self.factor_threshold))
                st["last_factor"].fill_(factor)
                if self._hold_factor:
                    factor = 1.0
                average = float(st["lamb_coeff_freeze"])
                updates = float(st.get("coeff_updates", 0.0))
                if corrected and not self._raw_coeff_average and updates > 0:  # an EMA started at 0
                    average /= 1 - self.coeff_beta**updates
                coeff = average * factor
                self._coeffs.append(coeff)
                p.add_(update, alpha=-step_size * coeff)
