"""Tokens per second and model FLOPs utilisation (MFU) for the training logs.

MFU = model FLOPs per token x tokens per second / (ranks x the accelerator's peak FLOP/s).

Model FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B) and nanoGPT's ``estimate_mfu``:
``6 N + 12 L H Q T``: N the parameters doing matrix work (every parameter but input-embedding tables,
whole over the tensor ranks), 6 for the forward (2) and backward (4) multiply-adds of each, and the
attention scores and values ``12 L H Q T`` (L layers, H heads, Q head size, T the sequence length the
batch brought). Recomputation (activation checkpointing) is not counted: it is hardware FLOPs, not model
FLOPs. The tokens are counted from each forward's input ids (a 2-D integer tensor, ``input_ids``
or the first integer argument): batch x sequence per micro-batch on this rank, times the data-parallel
replicas (and sequence-parallel ranks, each of which sees a slice of every sequence).

The peak comes from ``peak_tflops`` in the config (or ``SHARDWISE_PEAK_TFLOPS``), else from the table
below by the accelerator's name and the training dtype (dense tensor-core figures from the vendors'
data sheets, no sparsity). Without a peak (a CPU, an unknown accelerator) MFU is left out and the reason
is said once; tokens per second are still logged.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger("shardwise")

# device-name substring (lower case, most specific first) -> peak dense TFLOP/s by dtype
PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("gh200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("h200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("h100 pcie", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("h100 nvl", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("h100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM (e.g. "H100 80GB HBM3")
    ("h800", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("b200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 80.0}),
    ("a100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("a800", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("l40s", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    ("a10g", {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2}),
    ("v100", {"fp16": 125.0, "fp32": 15.7}),
    ("mi300x", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    ("mi325x", {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4}),
    ("mi250x", {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7}),
)


def peak_flops(device_name: str | None, dtype: str, *, override_tflops: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one accelerator, where it came from) or (None, why there is none)."""
    if override_tflops:
        return float(override_tflops) * 1e12, "peak_tflops"
    env = os.environ.get("SHARDWISE_PEAK_TFLOPS")
    if env:
        try:
            return float(env) * 1e12, "SHARDWISE_PEAK_TFLOPS"
        except ValueError:
            return None, f"SHARDWISE_PEAK_TFLOPS={env!r} is not a number"
    if not device_name:
        return None, "no accelerator (set peak_tflops in the config for an MFU figure)"
    name = device_name.lower()
    for key, table in PEAK_TFLOPS:
        if key in name:
            if dtype in table:
                return table[dtype] * 1e12, f"{device_name} {dtype}"
            return None, f"no {dtype} peak known for {device_name} (set peak_tflops in the config)"
    return None, f"no peak known for {device_name!r} (set peak_tflops in the config)"


def training_dtype_name(param_dtype: torch.dtype) -> str:
    if param_dtype == torch.bfloat16:
        return "bf16"
    if param_dtype == torch.float16:
        return "fp16"
    tf32 = torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


@dataclass(frozen=True)
class ModelFlops:
    """``6 * matmul_params + 12 * layers * heads * head_dim * T`` per token (``T`` from the batch)."""

    matmul_params: int
    layers: int = 0
    heads: int = 0
    head_dim: int = 0

    def per_token(self, seq_len: int) -> float:
        return 6.0 * self.matmul_params + 12.0 * self.layers * self.heads * self.head_dim * seq_len

    @property
    def counts_attention(self) -> bool:
        return self.layers > 0


def model_flops(module: torch.nn.Module, *, tensor_size: int = 1) -> ModelFlops:
    """The whole model's matrix parameters (a tensor-sharded parameter counts ``tensor_size`` times its
    shard, a ZeRO-3 one its whole size) and its attention shape, from a Hugging Face ``config`` or the
    reference GPT's ``cfg``; no attention term when neither is found."""
    from shardwise.zero.partitioned_param import full_numel

    embedding = set()
    matmul = set()
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if not isinstance(weight, torch.Tensor):
            continue
        if isinstance(m, torch.nn.Embedding) or type(m).__name__ in ("VocabParallelEmbedding", "Embedding"):
            embedding.add(id(weight))
        elif isinstance(m, torch.nn.Linear) or weight.dim() >= 2:
            matmul.add(id(weight))
    n = 0
    for p in module.parameters():
        if id(p) in embedding and id(p) not in matmul:  # a lookup table; a tied LM head does matrix work
            continue
        n += full_numel(p) * (tensor_size if getattr(p, "tensor_model_parallel", False) else 1)
    layers, heads, head_dim = _attention_shape(module)
    return ModelFlops(n, layers, heads, head_dim)


def _attention_shape(module: torch.nn.Module) -> tuple[int, int, int]:
    cfg = getattr(module, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
        layers = getattr(cfg, "num_hidden_layers", None)
        heads = getattr(cfg, "num_attention_heads", None)
        hidden = getattr(cfg, "hidden_size", None)
        if layers and heads and hidden:
            return int(layers), int(heads), int(getattr(cfg, "head_dim", None) or hidden // heads)
    # the reference GPT (shardwise.models.gpt) keeps its shape in ``cfg``; read by attribute, since the
    # monitors sit below the models in the import order
    for m in module.modules():
        c = getattr(m, "cfg", None)
        if all(isinstance(getattr(c, k, None), int) for k in ("n_layers", "n_heads", "hidden")):
            return c.n_layers, c.n_heads, c.hidden // c.n_heads
    return 0, 0, 0


def tokens_in(args, kwargs) -> tuple[int, int] | None:
    """(tokens, sequence length) of one forward's inputs: its ``input_ids`` (or first integer tensor) of
    shape [batch, sequence]; None when there is none (the rate is then left out)."""
    candidates = [kwargs.get("input_ids")] if isinstance(kwargs, dict) else []
    candidates += list(args)
    for t in candidates:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() and t.dtype != torch.bool:
            return t.numel(), t.shape[1]
    return None


class ThroughputMeter:
    """Counts tokens per optimizer step and turns an interval into tokens/s and MFU.

    ``replicas``: ranks whose tokens differ (data x sequence parallel); ``world``: every rank the
    model's FLOPs are spread over (for MFU, per accelerator)."""

    def __init__(self, flops: ModelFlops | None, *, replicas: int, world: int, peak: float | None,
                 peak_source: str, sequence_parallel: int = 1) -> None:
        self.flops, self.replicas, self.world = flops, max(replicas, 1), max(world, 1)
        self.peak, self.peak_source = peak, peak_source
        self.sequence_parallel = max(sequence_parallel, 1)
        self.tokens = 0  # tokens of the whole job (every replica) so far
        self.flop_total = 0.0  # model FLOPs of the whole job so far
        self.seq_len: int | None = None
        self._pending = 0  # this rank's tokens since the last step
        self._pending_flops = 0.0
        self.unknown_tokens = False
        self._marks: dict[str, tuple[float, int, float]] = {}
        self._said: set[str] = set()

    def observe(self, args, kwargs) -> None:
        found = tokens_in(args, kwargs)
        if found is None:
            self.unknown_tokens = True
            return
        tokens, seq = found
        seq *= self.sequence_parallel  # each sequence rank holds a slice: the attention spans the whole
        self.seq_len = seq
        self._pending += tokens
        if self.flops is not None:
            self._pending_flops += tokens * self.flops.per_token(seq)

    def step_done(self) -> None:
        self.tokens += self._pending * self.replicas
        self.flop_total += self._pending_flops * self.replicas
        self._pending, self._pending_flops = 0, 0.0

    def rates(self, key: str, now: float | None = None) -> dict:
        """Since the last call with ``key``: ``tokens_per_sec`` and ``mfu`` (a fraction), each None when not
        known; ``why`` says why MFU is missing."""
        now = time.perf_counter() if now is None else now
        last = self._marks.get(key)
        self._marks[key] = (now, self.tokens, self.flop_total)
        out = {"tokens_per_sec": None, "mfu": None, "why": None}
        if self.unknown_tokens and not self.tokens:
            out["why"] = "no token ids in the batch (a 2-D integer input_ids tensor)"
            return out
        if last is None:
            out["why"] = "first interval"
            return out
        dt = max(now - last[0], 1e-9)
        out["tokens_per_sec"] = (self.tokens - last[1]) / dt
        if self.peak is None:
            out["why"] = self.peak_source
        elif self.flops is None:
            out["why"] = "model FLOPs unknown"
        else:
            out["mfu"] = (self.flop_total - last[2]) / dt / (self.world * self.peak)
        return out

    def say_once(self, why: str | None) -> None:
        if why and why not in self._said and why != "first interval":
            self._said.add(why)
            logger.info("MFU not shown: %s", why)


def format_rates(r: dict) -> str:
    """``, tokens/sec=..., MFU=..%`` (what is known of it) for a log line."""
    text = ""
    if r.get("tokens_per_sec") is not None:
        text += f", tokens/sec={r['tokens_per_sec']:.1f}"
    if r.get("mfu") is not None:
        text += f", MFU={100 * r['mfu']:.1f}%"
    return text


def device_name(device) -> str | None:
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    if dev.type not in ("cpu", "meta"):
        try:
            from shardwise.accelerator import get_accelerator

            return str(get_accelerator().device_name(dev.index or 0))
        except Exception:  # noqa: BLE001 - an accelerator without a name: no peak
            return None
    return None
