"""A small GPT built from Megatron-style tensor-parallel layers.

The same layers serve three ways: ``GPT(cfg)`` (a plain module; at tensor size 1 an ordinary GPT),
``gpt_layer_specs(cfg)`` (a list of ``LayerSpec`` for a ``PipelineModule``) and
``gpt_pipeline_module(cfg, topology=...)``. Layer ``i`` is built after seeding the RNG with
``seed + i`` and its weights are initialised whole before being cut over the tensor ranks, so the
model is the same at every (data, pipe, tensor) size: parity tests compare against one process.

Activations are ``[batch, seq, hidden]``. With ``sequence_parallel=True`` the norm/dropout regions
between the tensor-parallel blocks hold ``seq / tp`` positions per tensor rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                       get_cuda_rng_tracker, scatter_to_sequence_parallel_region,
                                       vocab_parallel_cross_entropy)
from shardwise.topology import TENSOR_AXIS, tensor_parallel_group_and_size

__all__ = ["GPTConfig", "GPT", "gpt_layer_specs", "gpt_loss", "gpt_pipeline_module"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 64
    seq_len: int = 8
    hidden: int = 16
    n_layers: int = 2
    n_heads: int = 2
    mlp_ratio: int = 4
    dropout: float = 0.0
    sequence_parallel: bool = False


def _tp_size() -> int:
    return tensor_parallel_group_and_size()[1]


def _dropout(x: torch.Tensor, p: float, training: bool, *, sharded: bool) -> torch.Tensor:
    """Dropout on a tensor-sharded activation draws from the per-tensor-rank stream (when seeded with
    ``model_parallel_cuda_manual_seed``); on a replicated one from the default generator."""
    if p == 0.0 or not training:
        return x
    tracker = get_cuda_rng_tracker()
    if sharded and tracker.states_:
        with tracker.fork():
            return F.dropout(x, p, True)
    return F.dropout(x, p, True)


class GPTEmbedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden)
        self.tp_group = self.wte.group  # resolved once, here: the model keeps its grid's tensor group
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.wte(tokens) + self.wpe(pos)
        if self.cfg.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group, dim=1)
            return _dropout(x, self.cfg.dropout, self.training, sharded=True)
        return _dropout(x, self.cfg.dropout, self.training, sharded=False)


def _norm(cfg: GPTConfig) -> nn.LayerNorm:
    ln = nn.LayerNorm(cfg.hidden)
    for p in ln.parameters():  # on a sequence shard: gradients are partial sums over the tensor ranks
        p.sequence_parallel = cfg.sequence_parallel
    return ln


class GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        tp = _tp_size()
        if cfg.n_heads % tp:
            raise ValueError(f"GPTConfig.n_heads ({cfg.n_heads}) is not divisible by the tensor-parallel size ({tp})")
        self.cfg = cfg
        self.tp_size = tp
        self.local_heads = cfg.n_heads // tp
        self.head_dim = cfg.hidden // cfg.n_heads
        sp = dict(sequence_parallel=cfg.sequence_parallel, sequence_dim=1)
        self.ln1 = _norm(cfg)
        self.q = ColumnParallelLinear(cfg.hidden, cfg.hidden, gather_output=False, **sp)
        # No key bias: it shifts every score of a query row equally, so softmax makes its gradient exactly
        # zero, and Adam would turn the rounding noise in that zero into full-size updates.
        self.k = ColumnParallelLinear(cfg.hidden, cfg.hidden, bias=False, gather_output=False, **sp)
        self.v = ColumnParallelLinear(cfg.hidden, cfg.hidden, gather_output=False, **sp)
        self.proj = RowParallelLinear(cfg.hidden, cfg.hidden, input_is_parallel=True, **sp)
        self.ln2 = _norm(cfg)
        self.fc1 = ColumnParallelLinear(cfg.hidden, cfg.mlp_ratio * cfg.hidden, gather_output=False, **sp)
        self.fc2 = RowParallelLinear(cfg.mlp_ratio * cfg.hidden, cfg.hidden, input_is_parallel=True, **sp)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], (x.shape[1] * self.tp_size if self.cfg.sequence_parallel else x.shape[1])

        def heads(t):
            return t.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        att = _dropout(att, self.cfg.dropout, self.training, sharded=True)  # this rank's heads
        y = (att @ v).transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)
        return self.proj(y)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sharded = self.cfg.sequence_parallel
        x = x + _dropout(self._attention(self.ln1(x)), self.cfg.dropout, self.training, sharded=sharded)
        h = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + _dropout(h, self.cfg.dropout, self.training, sharded=sharded)


class GPTHead(nn.Module):
    """Final norm and the LM head; returns this tensor rank's vocabulary slice of the logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_f = _norm(cfg)
        self.lm_head = ColumnParallelLinear(cfg.hidden, cfg.vocab_size, bias=False, gather_output=False,
                                            sequence_parallel=cfg.sequence_parallel, sequence_dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def gpt_loss(vocab_parallel_logits: torch.Tensor, labels: torch.Tensor, *, group=TENSOR_AXIS) -> torch.Tensor:
    """Mean next-token loss from vocabulary-parallel logits (``ignore_index`` -100); ``group``: the
    tensor group the logits are sharded over (default: the active grid's, as the pipeline's loss)."""
    losses = vocab_parallel_cross_entropy(vocab_parallel_logits, labels, group=group)
    return losses.sum() / (labels != -100).sum().clamp(min=1)


def gpt_layer_specs(cfg: GPTConfig) -> list:
    from shardwise.pipe import LayerSpec

    return [LayerSpec(GPTEmbedding, cfg)] + [LayerSpec(GPTBlock, cfg) for _ in range(cfg.n_layers)] + \
        [LayerSpec(GPTHead, cfg)]


class GPT(nn.Sequential):
    """``GPT(cfg)(tokens)`` gives vocabulary-parallel logits; ``GPT(cfg)(tokens, labels)`` the mean loss.
    Layer ``i`` (``"<i>.<name>"`` parameters, as in the pipeline) is built after seeding with ``seed + i``."""

    def __init__(self, cfg: GPTConfig, *, seed: int = 1234) -> None:
        from shardwise.pipe.module import build_sequential

        super().__init__(*build_sequential(gpt_layer_specs(cfg), seed_layers=True, base_seed=seed))
        self.cfg = cfg

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None):
        logits = super().forward(tokens)
        return logits if labels is None else gpt_loss(logits, labels, group=self[-1].lm_head.group)


def gpt_pipeline_module(cfg: GPTConfig, *, topology=None, num_stages=None, seed: int = 1234, **kwargs):
    """The GPT as a ``PipelineModule`` (same layers and seeds as ``GPT(cfg, seed=seed)``)."""
    from shardwise.pipe import PipelineModule

    return PipelineModule(gpt_layer_specs(cfg), num_stages=num_stages, topology=topology, loss_fn=gpt_loss,
                          seed_layers=True, base_seed=seed, **kwargs)
