"""The hybrid engine: an RLHF actor that trains like ``Engine`` and generates between steps.

``initialize`` returns it when the config has ``"hybrid_engine": {"enabled": true}``. Its
``generate(...)`` (also put in place of the model's own ``generate``, which DeepSpeed-Chat calls
as ``engine.module.generate``) runs the model's Hugging Face ``generate`` with

- ZeRO-3 parameters gathered once for the whole call (``pin_parameters``, the default) rather than
  once per module per generated token, and released after it;
- LoRA layers fused into their base weights (DeepSpeed-Chat's ``LinearLayer_LoRA``, with
  ``fuse_lora_weight`` / ``unfuse_lora_weight``, and peft's layers, with ``merge`` / ``unmerge``) while
  the weights are whole, and the base weights put back exactly afterwards.

``eval()``/``train()`` switch modes as usual, and keep DeepSpeed's timing attributes
(``_generate_latency``, ``_gather_latency``, ``_training_latency``, ``_total_latency``, ``_iters``)
with its one summary line per ``eval()``. What DeepSpeed does with its own inference kernels
(``max_out_tokens`` workspaces, CUDA graphs, tensor-sliced generation) has no counterpart here:
see ``config/hybrid.py``.
"""

from __future__ import annotations

import contextlib
import time

import torch

from shardwise import comm
from shardwise.runtime.engine import Engine
from shardwise.utils.logging import log_dist

__all__ = ["HybridEngine", "DeepSpeedHybridEngine"]


class HybridEngine(Engine):
    """``Engine`` plus ``generate`` with weights gathered (ZeRO-3) and LoRA fused once per call."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._sync_rng()  # as DeepSpeed: every rank samples the same way
        self.Z3_enabled = self.zero_optimization_stage() == 3
        self.gather_all_layers = self.config.hybrid_engine.pin_parameters
        self._t_start = self._t0 = self._training_start_time = None
        self._total_latency = 0.0
        self._iters = 0
        self._generate_latency = self._training_latency = self._gather_latency = 0.0
        self._total_batch_size = None
        self.is_lora_fused = False
        self._generate = getattr(self.module, "generate", None)
        if self._generate is not None:
            self.module.generate = self.generate

    def _sync_rng(self) -> None:
        from shardwise.accelerator import get_accelerator

        acc = get_accelerator()
        state = acc.get_rng_state().to(self.device)
        if comm.get_world_size() > 1:
            comm.broadcast(state, src=0)
        acc.set_rng_state(state.cpu())

    # -- generation ---------------------------------------------------------------------------
    def generate(self, *inputs, **kwargs):
        if self._generate is None:
            raise ValueError(f"engine.generate(): the model ({type(self.module).__name__}) has no generate() method")
        if self._total_batch_size is None:
            ids = inputs[0] if inputs else kwargs.get("input_ids")
            if isinstance(ids, torch.Tensor):
                self._total_batch_size = ids.shape[0] * comm.get_world_size()
        self._t0 = time.time()
        with self._whole_weights():
            self._gather_latency = time.time() - self._t0
            with self._lora_fused():
                out = self._generate(*inputs, **kwargs)
        self._generate_latency = time.time() - self._t0 - self._gather_latency
        return out

    def _whole_weights(self):
        """ZeRO-3 with ``pin_parameters``: every parameter gathered once for the block."""
        coordinator = getattr(self.strategy, "coordinator", None)
        if self.Z3_enabled and self.gather_all_layers and coordinator is not None:
            return coordinator.held()
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _lora_fused(self):
        """Fuse the LoRA layers whose weights are whole here (not ZeRO-3 shards gathered per module);
        on exit restore each base weight bit for bit (unfusing by subtraction would round in 16 bits)."""
        layers = [t for t in _lora_layers(self.module) if t[0].numel() > 0]
        saved = [weight.data.clone() for weight, _, _ in layers]
        try:
            with torch.no_grad():
                for _, fuse, _ in layers:
                    fuse()
            self.is_lora_fused = bool(layers)
            yield
        finally:
            with torch.no_grad():
                for (weight, _, unfuse), w in zip(layers, saved):
                    unfuse()
                    weight.data.copy_(w)
            self.is_lora_fused = False

    # -- mode switches and timing ----------------------------------------------------------------
    def eval(self):
        if self._t_start is not None:
            latency = time.time() - self._t_start
            self._total_latency += latency
            self._iters += 1
            self._log_latency(latency)
            self._t_start = time.time()
        self._training_latency = 0.0
        super().eval()
        if self._t_start is None:
            self._t_start = time.time()
        return self

    def _log_latency(self, latency: float) -> None:
        pct = lambda t: 100 * t / latency if latency > 0 else 0.0  # noqa: E731
        others = latency - (self._generate_latency + self._training_latency)
        line = (f"|E2E latency={latency:.2f}s |Gather latency={self._gather_latency:.2f}s "
                f"({pct(self._gather_latency):.2f}%) |Generate time={self._generate_latency:.2f}s "
                f"({pct(self._generate_latency):.2f}%) |Training time={self._training_latency:.2f}s "
                f"({pct(self._training_latency):.2f}%) |Others={others:.2f} ({pct(others):.2f}%)")
        if self._total_batch_size is not None and latency > 0:
            line += (f"|CurSamplesPerSec={self._total_batch_size / latency:.2f} "
                     f"|AvgSamplesPerSec={self._total_batch_size * self._iters / self._total_latency:.2f}")
        log_dist(line, ranks=[0])

    def train(self, mode: bool = True):
        super().train(mode)
        if mode:
            self._training_start_time = time.time()
        return self

    def step(self, lr_kwargs=None) -> None:
        super().step(lr_kwargs=lr_kwargs)
        if self._training_start_time is not None:
            now = time.time()
            self._training_latency += now - self._training_start_time
            self._training_start_time = now


def _lora_layers(module: torch.nn.Module):
    """(base weight, fuse, unfuse) of each LoRA layer: DeepSpeed-Chat's ``LinearLayer_LoRA`` and peft's
    tuner layers (``merge``/``unmerge``; those already merged are left alone)."""
    for m in module.modules():
        if callable(getattr(m, "fuse_lora_weight", None)) and callable(getattr(m, "unfuse_lora_weight", None)):
            yield m.weight, m.fuse_lora_weight, m.unfuse_lora_weight
        elif callable(getattr(m, "get_base_layer", None)) and callable(getattr(m, "merge", None)) \
                and callable(getattr(m, "unmerge", None)) and getattr(m, "merged", True) is False:
            base = m.get_base_layer()
            if isinstance(getattr(base, "weight", None), torch.Tensor):
                yield base.weight, m.merge, m.unmerge


DeepSpeedHybridEngine = HybridEngine  # deepspeed.runtime.hybrid_engine.DeepSpeedHybridEngine
