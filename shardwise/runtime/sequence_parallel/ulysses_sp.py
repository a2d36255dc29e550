"""Ulysses sequence parallelism for Hugging Face Transformers (DeepSpeed's ALST ``ulysses_sp`` module).

- ``UlyssesSPAttentionHF``: wraps a Transformers attention function. Each rank of a sequence-parallel
  group holds ``seq/N`` tokens of every sequence and all heads; an all-to-all turns that into the whole
  sequence for ``heads/N`` heads, the core attention runs, and a second all-to-all turns the result
  back. Both exchanges are differentiable (the backward of an all-to-all is the reverse all-to-all).
- ``UlyssesSPAttentionHF.register_with_transformers(...)``: installs the wrapper in place of a core
  attention implementation (``sdpa``, ``flash_attention_2``, ``flex_attention``, ...) and returns the
  grid of the sequence-parallel groups (``shardwise.topology.ParallelGrid``) to pass to
  ``shardwise.initialize(mpu=...)`` (the compat package's ``deepspeed`` returns DeepSpeed's
  ``parallel_state_sp`` module instead, a view of the same grid).
- ``UlyssesSPDataLoaderAdapter``: gives each rank its slice of every sequence, with pre-shifted
  ``shift_labels`` and ``position_ids``.

Names, arguments and batch keys follow DeepSpeed 0.19.8; see docs/sequence-parallel.md.
The tiled computations (``TiledMLP``, ``TiledFusedLogitsLoss``, ``SequenceTiledCompute``,
``sequence_tiled_compute``) live in ``shardwise.runtime.sequence_parallel.tiled`` and are served
from here too.
"""

from __future__ import annotations

import importlib
from collections import deque
from typing import Any

import torch

from shardwise import comm
from shardwise.comm.autograd import all_to_all
from shardwise.utils.logging import logger

_TILED = ("TiledMLP", "TiledFusedLogitsLoss", "SequenceTiledCompute", "sequence_tiled_compute")
_UNSUPPORTED_CORE = ("eager", "paged|eager")
_ORIGINAL_ATTENTION: dict[str, Any] = {}  # core implementation name -> Transformers' own function


def __getattr__(name: str):
    if name in _TILED:  # deepspeed...ulysses_sp.TiledMLP & co: imported lazily from their own file
        return getattr(importlib.import_module("shardwise.runtime.sequence_parallel.tiled"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _all_to_all(group, x: torch.Tensor) -> torch.Tensor:
    return all_to_all(x, group=group)  # row j to rank j, row j of the result from rank j


class UlyssesSPAttentionHF(torch.nn.Module):
    """Sequence-sharded -> head-sharded attention around a Transformers attention function.

    Arguments (DeepSpeed's): ``attn`` the core attention function (an entry of Transformers'
    ``ALL_ATTENTION_FUNCTIONS``), ``batch_size``, ``attn_head_count``, ``attn_head_size``,
    ``kv_head_count``, ``num_hidden_layers``, ``process_group`` (the sequence-parallel group),
    ``seq_length_is_variable`` (shapes are read from every call), ``local_seq_length`` and
    ``global_seq_length`` (the fixed lengths otherwise), ``disable_in_eval`` (in eval mode call the
    core attention on whatever this rank holds, without exchanging anything).

    Query heads are split into ``N`` contiguous blocks, one per rank; key/value heads likewise when
    there are at least ``N`` of them, else each is repeated ``N / kv_heads`` times first so that every
    rank holds the one its query heads use.
    """

    def __init__(self, attn, batch_size: int, attn_head_count: int, attn_head_size: int, kv_head_count: int,
                 num_hidden_layers: int, process_group, seq_length_is_variable: bool = False,
                 local_seq_length: int | None = None, global_seq_length: int | None = None,
                 disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = comm.get_world_size(process_group)
        self.sp_rank = comm.get_rank(process_group)
        self.batch_size = batch_size
        self.seq_length_is_variable = seq_length_is_variable
        self.local_seq_length = local_seq_length
        self.global_seq_length = global_seq_length
        self.disable_in_eval = disable_in_eval
        self.attn_head_size = attn_head_size
        self.attn_head_count = attn_head_count
        self.global_kv_head_count = kv_head_count
        self.num_hidden_layers = num_hidden_layers
        self.core_attn_implementation = None  # set by register_with_transformers
        self._flex_block_mask_cached = None
        self._flex_block_mask_cache_key = None

        ws = self.world_size
        if attn_head_count % ws:
            raise ValueError(f"attention head count {attn_head_count} is not divisible by the sequence parallel "
                             f"size {ws}")
        if kv_head_count % ws and ws % kv_head_count:
            raise ValueError(f"key/value head count {kv_head_count} and the sequence parallel size {ws}: "
                             "one must divide the other")
        self.local_q_head_count = attn_head_count // ws
        self.kv_replication_factor = max(1, ws // kv_head_count)
        self.local_kv_head_count = max(1, kv_head_count // ws)
        if not seq_length_is_variable:
            if local_seq_length is None or global_seq_length is None:
                raise ValueError("seq_length_is_variable=False needs local_seq_length and global_seq_length")
            if local_seq_length * ws != global_seq_length:
                raise ValueError(f"global_seq_length {global_seq_length} != local_seq_length {local_seq_length} x "
                                 f"sequence parallel size {ws}")

    # -- the two exchanges ------------------------------------------------------------------------
    def _gather_sequence(self, x: torch.Tensor, heads_per_rank: int) -> torch.Tensor:
        """[bs, heads, sl_l, hs] (all heads, my tokens) -> [bs, heads/N, sl, hs] (my heads, all tokens)."""
        bs, _, sl_l, hs = x.shape
        ws = self.world_size
        x = x.reshape(bs, ws, heads_per_rank, sl_l, hs).transpose(0, 1)  # [ws, bs, h_l, sl_l, hs]
        x = _all_to_all(self.process_group, x)  # row j: rank j's tokens of my heads
        return x.permute(1, 2, 0, 3, 4).reshape(bs, heads_per_rank, ws * sl_l, hs)

    def _scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """[bs, sl, heads/N, hs] (my heads, all tokens) -> [bs, sl_l, heads*hs] (all heads, my tokens)."""
        bs, sl, h_l, hs = x.shape
        ws = self.world_size
        x = x.reshape(bs, ws, sl // ws, h_l, hs).transpose(0, 1)  # [ws, bs, sl_l, h_l, hs]
        x = _all_to_all(self.process_group, x)  # row j: my tokens of rank j's heads
        return x.permute(1, 2, 0, 3, 4).reshape(bs, sl // ws, ws * h_l * hs)

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        bs, hc, sl_l, hs = query.shape
        if self.seq_length_is_variable:
            self.local_seq_length, self.global_seq_length = sl_l, sl_l * self.world_size
        want_q = (self.batch_size, self.attn_head_count, self.local_seq_length, self.attn_head_size)
        want_kv = (self.batch_size, self.global_kv_head_count, self.local_seq_length, self.attn_head_size)
        if self.seq_length_is_variable:  # the batch size may change too (a last, smaller batch)
            want_q, want_kv = (bs, *want_q[1:]), (bs, *want_kv[1:])
        if tuple(query.shape) != want_q or tuple(key.shape) != want_kv or tuple(value.shape) != want_kv:
            raise ValueError(f"rank {comm.get_rank()}: Ulysses attention expects query {want_q} and key/value "
                             f"{want_kv} ([batch, heads, local sequence, head size]); got query "
                             f"{tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")

    def _gather_position_ids(self, position_ids: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(position_ids) for _ in range(self.world_size)]
        comm.all_gather(parts, position_ids.contiguous(), group=self.process_group)
        return torch.cat(parts, dim=1)

    def _flex_causal_mask(self, attention_mask, batch_size: int, seq_len: int, device):
        """flex_attention: the model built its BlockMask for the local length; rebuild it (causal) for the
        gathered sequence, once per shape."""
        from torch.nn.attention.flex_attention import BlockMask, create_block_mask

        if not isinstance(attention_mask, BlockMask):
            return attention_mask
        key = (batch_size, seq_len)
        if self._flex_block_mask_cache_key != key:
            def causal(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx

            self._flex_block_mask_cached = create_block_mask(causal, B=batch_size, H=None, Q_LEN=seq_len,
                                                             KV_LEN=seq_len, device=device)
            self._flex_block_mask_cache_key = key
        return self._flex_block_mask_cached

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask, *args: Any, **kwargs: Any):
        """Transformers' attention-function signature: ``query``/``key``/``value`` are
        [batch, heads, local sequence, head size]; returns ([batch, local sequence, heads*head size], weights)."""
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_shapes(query, key, value)
        if kwargs.get("position_ids") is None:
            raise ValueError("Ulysses sequence parallelism needs position_ids in every forward call: without them "
                             "each rank numbers its own tokens 0..n-1 and the gathered sequence looks like packed "
                             "documents. Pass position_ids (UlyssesSPDataLoaderAdapter adds them to the batch).")
        kwargs["position_ids"] = self._gather_position_ids(kwargs["position_ids"])

        if self.kv_replication_factor > 1:  # fewer kv heads than ranks: every rank gets a copy of its kv head
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        q = self._gather_sequence(query, self.local_q_head_count)
        k = self._gather_sequence(key, self.local_kv_head_count)
        v = self._gather_sequence(value, self.local_kv_head_count)

        if self.core_attn_implementation == "flex_attention":
            attention_mask = self._flex_causal_mask(attention_mask, q.shape[0], q.shape[2], q.device)

        # the core attention repeats kv heads by module.num_key_value_groups: the local ratio differs
        # from the model's when kv heads were replicated; set it for this call only
        groups = getattr(module, "num_key_value_groups", None)
        if groups is not None:
            module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            context, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)  # [bs, sl, h_l, hs]
        finally:
            if groups is not None:
                module.num_key_value_groups = groups
        return self._scatter_sequence(context), weights

    @classmethod
    def register_with_transformers(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                                   micro_batch_size, seq_length=None, seq_length_is_variable=True,
                                   disable_in_eval=False, max_length=None, *, tensor_parallel_size=None,
                                   config=None):
        """Install Ulysses attention in place of ``core_attn_implementation`` in Transformers and return
        the grid of its groups (it answers ``get_sequence_parallel_group()`` & co., as DeepSpeed's mpu does)
        for ``shardwise.initialize(mpu=...)``; ``None`` when
        ``sequence_parallel_size`` is 1.

        ``model_name_or_path``: a loaded model (anything with ``.config``), or a hub name or local path
        whose config is read. Call it before ``from_pretrained`` (and pass the same
        ``attn_implementation``). ``seq_length``: the fixed global sequence length when
        ``seq_length_is_variable`` is False. ``max_length`` is the deprecated name of ``seq_length``.

        With AutoTP as well (shardwise only): ``tensor_parallel_size`` T, or ``config`` (the shardwise /
        DeepSpeed config dict or JSON path given to ``initialize``) whose ``tensor_parallel.autotp_size``
        says it, or an earlier ``tp_model_init(tp_size=T)``. The grid is then data x sequence x tensor:
        each tensor rank holds heads/T of every attention and exchanges them over its sequence group.
        """
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("register_with_transformers: 'max_length' is deprecated, use 'seq_length'")
            if seq_length is None:
                seq_length = max_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError("register_with_transformers: seq_length_is_variable=False needs seq_length (the fixed "
                             "global sequence length)")
        from transformers import AutoConfig
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        from shardwise.runtime.sequence_parallel.groups import sequence_parallel_grid

        tp = _tensor_size(tensor_parallel_size, config)
        grid = sequence_parallel_grid(sequence_parallel_size, tensor_parallel_size=tp)

        loaded = hasattr(model_name_or_path, "config")
        hf_config = model_name_or_path.config if loaded else AutoConfig.from_pretrained(model_name_or_path)
        if loaded:
            have = getattr(hf_config, "_attn_implementation", None)
            if have is not None and have != core_attn_implementation:
                raise ValueError(f"core_attn_implementation={core_attn_implementation!r} does not match the model's "
                                 f"attn_implementation {have!r}: use the same for both so that Ulysses attention "
                                 "replaces the one the model calls")
        if core_attn_implementation in _UNSUPPORTED_CORE:
            raise ValueError(f"attn_implementation {core_attn_implementation!r} cannot be used with Ulysses sequence "
                             "parallelism: it needs a 4D attention mask of the whole sequence (O(n^2) memory). Use "
                             "'sdpa', 'flex_attention' or a flash attention implementation")
        if core_attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{core_attn_implementation!r} is not an attention implementation Transformers knows; "
                             f"choose one of {list(ALL_ATTENTION_FUNCTIONS.valid_keys())}")
        # wrap Transformers' own function, never a wrapper installed by an earlier call
        core = _ORIGINAL_ATTENTION.setdefault(core_attn_implementation,
                                              ALL_ATTENTION_FUNCTIONS[core_attn_implementation])

        if seq_length_is_variable:
            local_seq_length = global_seq_length = None
        else:
            if seq_length % sequence_parallel_size:
                raise ValueError(f"seq_length {seq_length} is not divisible by sequence_parallel_size "
                                 f"{sequence_parallel_size}")
            local_seq_length, global_seq_length = seq_length // sequence_parallel_size, seq_length
        text = hf_config.get_text_config()
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        if heads % tp or kv_heads % tp:
            raise ValueError(f"{type(text).__name__} has num_attention_heads = {heads} and num_key_value_heads = "
                             f"{kv_heads}; both must be divisible by the tensor-parallel size {tp}")
        uattn = cls(attn=core, batch_size=micro_batch_size, attn_head_count=heads // tp,  # this tensor rank's heads
                    attn_head_size=head_dim, kv_head_count=kv_heads // tp,
                    num_hidden_layers=text.num_hidden_layers, process_group=grid.get_sequence_parallel_group(),
                    seq_length_is_variable=seq_length_is_variable, local_seq_length=local_seq_length,
                    global_seq_length=global_seq_length, disable_in_eval=disable_in_eval)
        uattn.core_attn_implementation = core_attn_implementation

        def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
            # The mask Transformers built covers the local shard only (and a 4D one for the whole sequence
            # would be O(n^2)): drop it; causality comes from the core attention and the gathered
            # position_ids. flex_attention's BlockMask is kept and rebuilt for the whole sequence.
            if core_attn_implementation != "flex_attention" or not _is_block_mask(attention_mask):
                attention_mask = None
            return uattn(module, query, key, value, attention_mask, *args, **kwargs)

        # Replace the core implementation's entry rather than registering a new name, so that every
        # branch Transformers takes on the implementation's name still runs (as DeepSpeed does).
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        ulysses_attention.ulysses = uattn
        return grid


def _tensor_size(explicit, config) -> int:
    """The tensor-parallel size ``register_with_transformers`` lays the grid out for: the argument, else the
    config's ``tensor_parallel.autotp_size``, else an earlier ``tp_model_init``; two that differ are an error."""
    from shardwise.tensor_parallel import autotp

    found = {}
    if explicit is not None:
        found["tensor_parallel_size"] = explicit
    if config is not None:
        if isinstance(config, (str, bytes)) or hasattr(config, "__fspath__"):
            import json

            with open(config) as f:
                config = json.load(f)
        size = (config.get("tensor_parallel") or {}).get("autotp_size", 0) if isinstance(config, dict) else \
            config.tensor_parallel.autotp_size
        if size:
            found["the config's tensor_parallel.autotp_size"] = size
    if autotp._TP_MODEL_INIT_ARGS is not None:
        found["tp_model_init(tp_size=...)"] = autotp._TP_MODEL_INIT_ARGS["tp_size"]
    if len(set(found.values())) > 1:
        raise ValueError("register_with_transformers: tensor-parallel sizes disagree: "
                         + ", ".join(f"{k} = {v}" for k, v in found.items()))
    return next(iter(found.values()), 1)


def _is_block_mask(mask) -> bool:
    from torch.nn.attention.flex_attention import BlockMask

    return isinstance(mask, BlockMask)


class UlyssesSPDataLoaderAdapter:
    """Wrap a DataLoader so that each rank of a sequence-parallel group gets its slice of every sequence.

    Each rank's loader yields its own batches (dicts of ``[batch, seqlen, ...]`` tensors with at least
    ``input_ids``, ``position_ids`` and ``labels``). On each refill the group exchanges one batch per
    rank; the next ``sp_world_size`` iterations then return batch 0 (from sp rank 0), batch 1, ... each
    cut along the sequence: rank ``r`` gets tokens ``[r*L/N, (r+1)*L/N)``. ``labels`` is replaced by
    ``shift_labels`` (the labels shifted left by one over the *whole* sequence, -100 at the end), so
    the loss of every shard is right. Non-tensor entries are copied to every rank. Shards are returned
    on the CPU (move them to the device yourself, as with DeepSpeed).
    """

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size, device) -> None:
        self.dl = dl
        self.sp_rank = sp_rank
        self.sp_group = sp_group
        self.sp_world_size = sp_world_size
        self.device = device
        self.iter = iter(dl)
        self.micro_batches: deque = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        return self

    def __next__(self):
        if not self.micro_batches:
            self.refill()
        return self.micro_batches.popleft()

    def _gather_batches(self, batch: dict) -> list[dict]:
        """Every sp rank's batch, in sp-rank order (tensors of different lengths are padded to travel)."""
        desc = {k: (tuple(v.shape), str(v.dtype)) if torch.is_tensor(v) else ("object", v) for k, v in batch.items()}
        ranks = [comm.get_global_rank(self.sp_group, r) for r in range(self.sp_world_size)]
        descs = [comm.broadcast_object(desc if comm.get_rank() == src else None, src=src, group=self.sp_group)
                 for src in ranks]
        keys = list(batch.keys())
        for r, d in enumerate(descs):
            if list(d.keys()) != keys:
                raise ValueError(f"UlyssesSPDataLoaderAdapter: sp rank {r}'s batch has keys {list(d.keys())}, this "
                                 f"rank's has {keys}: every rank's loader must yield the same keys")
        out: list[dict] = [{} for _ in range(self.sp_world_size)]
        for k in keys:
            if descs[0][k][0] == "object":
                for r in range(self.sp_world_size):
                    out[r][k] = descs[r][k][1]
                continue
            shapes = [d[k][0] for d in descs]
            longest = max(s[1] for s in shapes)
            t = batch[k].to(self.device)
            with torch.no_grad():
                if t.shape[1] < longest:  # pad along the sequence so every rank sends the same shape
                    pad = torch.zeros((t.shape[0], longest - t.shape[1], *t.shape[2:]), dtype=t.dtype, device=t.device)
                    t = torch.cat([t, pad], dim=1)
                parts = [torch.empty_like(t) for _ in range(self.sp_world_size)]
                comm.all_gather(parts, t.contiguous(), group=self.sp_group)
            for r, (part, shape) in enumerate(zip(parts, shapes)):
                out[r][k] = part[:, :shape[1]]
        return out

    def refill(self) -> None:
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)  # ready for the next epoch
            raise
        if not isinstance(batch, dict):
            raise ValueError(f"UlyssesSPDataLoaderAdapter needs batches that are dicts (input_ids, position_ids, "
                             f"labels, ...); the loader yielded a {type(batch).__name__}")
        if "position_ids" not in batch:
            raise ValueError("UlyssesSPDataLoaderAdapter: the batch has no 'position_ids'. Each token must keep its "
                             "position in the whole sequence after sharding: add position_ids to the collator's "
                             "output (torch.arange(seq_len) per sample, or restarting at each packed document)")
        seqlen = batch["input_ids"].shape[1]
        for k, v in batch.items():
            if torch.is_tensor(v) and (v.dim() < 2 or v.shape[1] != seqlen):
                raise ValueError(f"UlyssesSPDataLoaderAdapter: batch[{k!r}] has shape {tuple(v.shape)}; every tensor "
                                 f"must be [batch, seqlen, ...] with input_ids' seqlen {seqlen}")
        for sample_rank, full in enumerate(self._gather_batches(batch)):
            length = full["input_ids"].shape[1]
            if length % self.sp_world_size:
                raise ValueError(f"UlyssesSPDataLoaderAdapter: sp rank {sample_rank}'s batch has sequence length "
                                 f"{length}, not divisible by the sequence parallel size {self.sp_world_size}; pad "
                                 "sequences to a multiple of it")
            chunk = length // self.sp_world_size
            if "labels" in full:  # shift over the whole sequence before cutting it (the loss is per shard)
                labels = full.pop("labels")
                full["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
            lo, hi = chunk * self.sp_rank, chunk * (self.sp_rank + 1)
            shard = {k: v[:, lo:hi].cpu().clone() if torch.is_tensor(v) else v for k, v in full.items()}
            self.micro_batches.append(shard)
