"""A small GPT built from Megatron-style tensor-parallel layers.

The same layers serve three ways: ``GPT(cfg)`` (a plain module; at tensor size 1 an ordinary GPT),
``gpt_layer_specs(cfg)`` (a list of ``LayerSpec`` for a ``PipelineModule``) and
``gpt_pipeline_module(cfg, topology=...)``. Layer ``i`` is built after seeding the RNG with
``seed + i`` and its weights are initialised whole before being cut over the tensor ranks, so the
model is the same at every (data, pipe, tensor) size: parity tests compare against one process.

Activations are ``[batch, seq, hidden]``. With ``sequence_parallel=True`` the norm/dropout regions
between the tensor-parallel blocks hold ``seq / tp`` positions per tensor rank.

Ulysses sequence parallelism (DeepSpeed's ``DistributedAttention``, as Megatron-DeepSpeed uses it) is on
whenever the grid the model runs in has a sequence axis (size N > 1): each rank is fed ``seq / N``
consecutive tokens of every sequence (its sequence rank's slice) and their labels; attention exchanges
heads for tokens around the core attention, and ``gpt_loss`` sums the slices' losses over the sequence
group, so every rank returns the loss of the whole sequences. Composes with tensor parallelism (each
tensor rank's heads are exchanged) and with pipelines.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import comm
from shardwise.sequence.layer import seq_all_to_all, sequence_sum
from shardwise.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                       get_cuda_rng_tracker, scatter_to_sequence_parallel_region,
                                       vocab_parallel_cross_entropy)
from shardwise.topology import TENSOR_AXIS, active_grid, tensor_parallel_group_and_size

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


def _sequence_axis():
    """(group, size, rank) of the active grid's sequence axis (Ulysses); size 1 without one."""
    grid = active_grid()
    if grid is None or grid.size("sequence") == 1:
        return None, 1, 0
    return grid.group("sequence"), grid.size("sequence"), grid.axis_rank("sequence")


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
        _, _, sp_rank = _sequence_axis()  # Ulysses: these tokens are slice sp_rank of every sequence
        local = tokens.shape[1]
        pos = torch.arange(sp_rank * local, (sp_rank + 1) * local, device=tokens.device)
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
        group, sp, _ = _sequence_axis()
        if sp > 1 and self.cfg.sequence_parallel:
            raise ValueError("GPTConfig.sequence_parallel=True (Megatron's, over the tensor ranks) with Ulysses "
                             f"sequence parallelism (sequence size {sp}): use one of them")
        if self.local_heads % sp:
            raise ValueError(f"GPTConfig.n_heads ({self.cfg.n_heads}) must divide by tensor size x sequence size: "
                             f"this tensor rank's {self.local_heads} heads do not divide by the sequence size {sp}")
        b = x.shape[0]
        q, k, v = self.q(x), self.k(x), self.v(x)  # the whole sequence under Megatron's sequence parallelism
        here = q.shape[1]
        q, k, v = (t.view(b, here, self.local_heads, self.head_dim) for t in (q, k, v))
        if sp > 1:  # Ulysses: this rank's tokens of all (local) heads -> every token of local_heads / sp heads
            q, k, v = (seq_all_to_all(t, 2, 1, group) for t in (q, k, v))
        s = q.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        att = _dropout(att, self.cfg.dropout, self.training, sharded=True)  # this rank's heads
        y = (att @ v).transpose(1, 2)  # [b, s, heads here, head_dim]
        if sp > 1:
            y = seq_all_to_all(y, 1, 2, group)  # back to this rank's tokens of all local heads
        return self.proj(y.reshape(b, here, self.local_heads * self.head_dim))

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
    """Mean next-token loss from vocabulary-parallel logits (``ignore_index`` -100). Under Ulysses each rank
    holds a slice of every sequence: the slices' sums are added over the sequence group, so every rank
    returns the mean over the whole sequences. ``group``: the tensor group the logits are sharded over (default:
    the active grid's, as the pipeline's loss)."""
    losses = vocab_parallel_cross_entropy(vocab_parallel_logits, labels, group=group)
    total, count = losses.sum(), (labels != -100).sum()
    sp_group, sp, _ = _sequence_axis()
    if sp > 1:
        total = sequence_sum(total, sp_group)
        count = count.clone()
        comm.all_reduce(count, group=sp_group)
    return total / count.clamp(min=1)


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
