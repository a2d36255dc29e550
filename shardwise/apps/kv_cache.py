"""A paged KV cache with prefix caching, for the batching engine (``shardwise.apps.batching``).

The keys and values of every layer live in one pool of fixed-size *blocks* per layer
(``[blocks * block_size, kv_heads, head_dim]`` for K and for V). A sequence owns a *block
table*: the blocks that hold its tokens in order, so it takes ``ceil(tokens / block_size)``
blocks and no padding. The pool's size is fixed by a byte budget; a request is admitted only
when the blocks it may need (prompt plus its whole token limit) are free, otherwise it waits.

Prefix caching: a block that is full is registered under a key made of its tokens and the key
of the block before it (so the key names the whole token prefix, and the adapter). A new
request looks its prompt's full blocks up one by one and shares every block found, computing
only the rest of its prompt. Blocks no sequence uses any more stay cached until their room is
needed, then the least recently used go first.

One forward pass serves every sequence at once: their new tokens are packed into one row
(``input_ids`` of shape ``(1, tokens)`` with each token's own position), :class:`PagedCache`
writes each token's K/V into its slot as a layer runs, and :func:`paged_attention` (registered
as a transformers attention implementation) lets each sequence's queries attend to its own
blocks only, causally. Models whose attention goes through transformers' attention interface
and ``cache.update`` (Llama, Mistral, Qwen2 and most decoder-only models) work unchanged.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass, field

import torch

__all__ = ["BlockPool", "PagedKV", "Sequence", "kv_bytes_per_token", "model_kv_shape"]

ATTENTION_NAME = "shardwise_paged"


def model_kv_shape(config) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers model config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers = int(text.num_hidden_layers)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return layers, kv_heads, head_dim


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in every layer: ``2 * layers * kv_heads * head_dim * dtype bytes``."""
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass
class Sequence:
    """One request's place in the pool."""
    adapter: int
    reserve: int  # blocks this sequence may hold at most (prompt plus its token limit)
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V are written, in order
    cached: int = 0  # prompt tokens found in the prefix cache
    keys: list = field(default_factory=list)  # the prefix key of each full block


class BlockPool:
    """Block bookkeeping: free blocks, reference counts, the prefix table and its LRU order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.refs = [0] * num_blocks
        self.table: dict = {}  # prefix key -> block
        self.key_of: dict[int, object] = {}  # block -> prefix key (registered blocks)
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # unreferenced registered blocks
        self.reserved = 0  # blocks promised to admitted sequences and not yet taken
        self.hits = 0  # prompt blocks found in the cache
        self.lookups = 0  # prompt blocks looked up
        self.evictions = 0

    @property
    def available(self) -> int:
        """Blocks that can still be promised: free or evictable, less those already promised."""
        return len(self.free) + len(self.lru) - self.reserved

    def key(self, parent, tokens: tuple[int, ...], adapter: int):
        return (hash(parent) if parent is not None else None, tokens, adapter)

    def lookup(self, prompt: list[int], adapter: int) -> list[int]:
        """The cached blocks of ``prompt``'s longest cached prefix of full blocks (not yet taken)."""
        found, parent = [], None
        bs = self.block_size
        for start in range(0, len(prompt) - bs + 1, bs):
            key = self.key(parent, tuple(prompt[start:start + bs]), adapter)
            block = self.table.get(key)
            if block is None:
                break
            found.append(block)
            parent = key
        return found

    def take_cached(self, block: int) -> None:
        if self.refs[block] == 0:
            self.lru.pop(block, None)
        self.refs[block] += 1

    def allocate(self) -> int:
        """A block for new tokens: a free one, else the least recently used cached one."""
        if self.free:
            block = self.free.popleft()
        elif self.lru:
            block, _ = self.lru.popitem(last=False)
            del self.table[self.key_of.pop(block)]
            self.evictions += 1
        else:  # admission promised room; reaching here is a bookkeeping bug
            raise RuntimeError("the KV cache has no free block left")
        self.refs[block] = 1
        return block

    def register(self, block: int, key) -> None:
        if key not in self.table and block not in self.key_of:
            self.table[key] = block
            self.key_of[block] = key

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.key_of:
                self.lru[block] = None
            else:
                self.free.append(block)


class PagedKV:
    """The pools of K/V blocks for every layer of ``model`` and the sequences in them."""

    def __init__(self, model, *, max_bytes: int, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"kv_block_size must be at least 1, got {block_size}")
        self.layers, self.kv_heads, self.head_dim = model_kv_shape(model.config)
        param = next(model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.block_size = block_size
        self.bytes_per_token = kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, self.dtype)
        self.bytes_per_block = self.bytes_per_token * block_size
        num_blocks = max_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes {max_bytes} holds no block of the KV cache: one block of {block_size} "
                             f"tokens takes {self.bytes_per_block} bytes ({self.bytes_per_token} per token)")
        self.pool = BlockPool(num_blocks, block_size)
        self.live: dict[int, Sequence] = {}  # admitted sequences not yet released, by id
        self._live_lock = threading.Lock()  # stats() is read from other threads
        slots = num_blocks * block_size
        shape = (slots, self.kv_heads, self.head_dim)
        # Never-written slots are never read (padding in a decoding step points at a written slot),
        # so the pools need no zeroing: on a CPU their pages are only touched as blocks are used.
        self.k = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]
        self.v = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)]

    # ---- admission and bookkeeping ------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def admit(self, prompt: list[int], max_new_tokens: int, adapter: int) -> Sequence | None:
        """A sequence for ``prompt`` with its cached prefix taken, or None when the pool cannot
        promise the blocks it may need (the request waits)."""
        pool, bs = self.pool, self.block_size
        need = self.blocks_for(len(prompt) + max_new_tokens - 1)  # the last token's K/V is never written
        hits = pool.lookup(prompt, adapter)
        if hits and len(hits) * bs >= len(prompt):
            hits = hits[:-1]  # the last prompt token must be computed: its logits give the first answer token
        evictable_hits = sum(1 for b in hits if pool.refs[b] == 0)
        if pool.available - evictable_hits < need - len(hits):
            return None
        pool.lookups += len(prompt) // bs
        pool.hits += len(hits)
        seq = Sequence(adapter=adapter, reserve=need)
        parent = None
        for i, block in enumerate(hits):
            pool.take_cached(block)
            seq.blocks.append(block)
            parent = pool.key(parent, tuple(prompt[i * bs:(i + 1) * bs]), adapter)
            seq.keys.append(parent)
        seq.tokens = list(prompt[:len(hits) * bs])
        seq.cached = len(seq.tokens)
        pool.reserved += need - len(hits)
        with self._live_lock:
            self.live[id(seq)] = seq
        return seq

    def slots_for(self, seq: Sequence, new_tokens: list[int]) -> list[int]:
        """Slots for ``new_tokens`` appended to ``seq`` (blocks taken as needed)."""
        pool, bs = self.pool, self.block_size
        slots = []
        for token in new_tokens:
            position = len(seq.tokens)
            if position % bs == 0:
                if len(seq.blocks) >= seq.reserve:
                    raise RuntimeError("a sequence outgrew the KV blocks reserved for it")
                seq.blocks.append(pool.allocate())
                pool.reserved -= 1
            seq.tokens.append(token)
            slots.append(seq.blocks[position // bs] * bs + position % bs)
        return slots

    def commit(self, seq: Sequence) -> None:
        """Register ``seq``'s blocks that are full (call once their K/V are written)."""
        pool, bs = self.pool, self.block_size
        for i in range(len(seq.keys), len(seq.tokens) // bs):
            parent = seq.keys[-1] if seq.keys else None
            key = pool.key(parent, tuple(seq.tokens[i * bs:(i + 1) * bs]), seq.adapter)
            seq.keys.append(key)
            pool.register(seq.blocks[i], key)

    def release(self, seq: Sequence) -> None:
        with self._live_lock:
            self.live.pop(id(seq), None)
        self.pool.reserved -= seq.reserve - len(seq.blocks)
        for block in seq.blocks:
            self.pool.release(block)
        seq.blocks, seq.reserve = [], 0

    def context_slots(self, seq: Sequence) -> torch.Tensor:
        bs = self.block_size
        blocks = torch.tensor(seq.blocks, dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs)).reshape(-1)
        return slots[:len(seq.tokens)]

    def stats(self) -> dict:
        pool = self.pool
        with self._live_lock:
            active = list(self.live.values())
        used = pool.num_blocks - len(pool.free) - len(pool.lru)
        return {"blocks_total": pool.num_blocks, "blocks_used": used, "blocks_cached": len(pool.lru),
                "blocks_free": len(pool.free), "block_size": self.block_size,
                "bytes_per_token": self.bytes_per_token, "bytes_total": pool.num_blocks * self.bytes_per_block,
                "bytes_used": used * self.bytes_per_block,
                "active_tokens": sum(len(s.tokens) for s in active), "active_sequences": len(active),
                "prefix_hits": pool.hits, "prefix_lookups": pool.lookups, "evictions": pool.evictions}

    # ---- one forward pass ----------------------------------------------------------
    def plan(self, seqs: list[Sequence], new: list[list[int]]) -> "_Plan":
        """Write slots and attention layout for appending ``new[i]`` to ``seqs[i]``."""
        write, prefill, decode_rows, decode_seqs = [], [], [], []
        start = 0
        for seq, tokens in zip(seqs, new):
            write.extend(self.slots_for(seq, tokens))
            if len(tokens) == 1:
                decode_rows.append(start)
                decode_seqs.append(seq)
            else:
                prefill.append((start, len(tokens), self.context_slots(seq).to(self.device)))
            start += len(tokens)
        plan = _Plan(self, torch.tensor(write, dtype=torch.long, device=self.device), prefill)
        if decode_rows:
            # every decoding sequence's slots at once; padding reads the sequence's first slot
            # (masked out), never uninitialised memory, whose NaNs would survive a zero weight
            bs = self.block_size
            width = max(len(s.blocks) for s in decode_seqs)
            table = torch.tensor([s.blocks + s.blocks[:1] * (width - len(s.blocks)) for s in decode_seqs],
                                 dtype=torch.long, device=self.device)
            index = (table[:, :, None] * bs + torch.arange(bs, device=self.device)).reshape(len(decode_seqs), -1)
            lengths = torch.tensor([len(s.tokens) for s in decode_seqs], device=self.device)
            mask = torch.arange(index.shape[1], device=self.device)[None] < lengths[:, None]
            index = torch.where(mask, index, index[:, :1])  # the unwritten end of a last block too
            plan.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=self.device)
            plan.decode_index = index
            plan.decode_mask = mask[:, None, None, :]
        return plan


class _Plan:
    """What one packed forward pass writes and reads; handed to the model as ``cache`` and to
    the attention function through the forward's keyword arguments."""

    def __init__(self, kv: PagedKV, write: torch.Tensor, prefill) -> None:
        self.kv, self.write, self.prefill = kv, write, prefill
        self.decode_rows = self.decode_index = self.decode_mask = None
        self.layer = 0


class PagedCache:
    """The ``cache`` object the model sees during a paged forward pass: ``update`` writes the new
    tokens' K/V into their slots and hands them on unchanged (attention reads the pool)."""

    is_compileable = False
    is_sliding = [False]

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kv = self.plan.kv
        if key_states.shape[0] != 1 or key_states.shape[1] != kv.kv_heads or key_states.shape[-1] != kv.head_dim:
            raise RuntimeError(f"the paged KV cache expected keys of shape (1, {kv.kv_heads}, tokens, {kv.head_dim}) "
                               f"from layer {layer_idx}, got {tuple(key_states.shape)}")
        kv.k[layer_idx].index_copy_(0, self.plan.write, key_states[0].transpose(0, 1).to(kv.dtype))
        kv.v[layer_idx].index_copy_(0, self.plan.write, value_states[0].transpose(0, 1).to(kv.dtype))
        self.plan.layer = layer_idx
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return self.plan.kv.layers


def paged_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention of packed queries ``(1, heads, tokens, head_dim)`` over each sequence's blocks."""
    plan: _Plan = kwargs["shardwise_paged"]
    kv = plan.kv
    pool_k, pool_v = kv.k[plan.layer], kv.v[plan.layer]
    heads = query.shape[1]
    gqa = heads != kv.kv_heads
    out = query.new_empty((query.shape[2], heads, query.shape[3]))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for start, count, ctx in plan.prefill:
        q = query[:, :, start:start + count]
        k = pool_k.index_select(0, ctx).transpose(0, 1)[None].to(q.dtype)
        v = pool_v.index_select(0, ctx).transpose(0, 1)[None].to(q.dtype)
        past = len(ctx) - count
        if past == 0:
            o = sdpa(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            mask = torch.ones((count, len(ctx)), dtype=torch.bool, device=q.device).tril(diagonal=past)
            o = sdpa(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out[start:start + count] = o[0].transpose(0, 1)
    if plan.decode_rows is not None:
        q = query[0].index_select(1, plan.decode_rows).transpose(0, 1)[:, :, None]  # (rows, heads, 1, dim)
        k = pool_k[plan.decode_index].transpose(1, 2).to(q.dtype)  # (rows, kv_heads, width, dim)
        v = pool_v[plan.decode_index].transpose(1, 2).to(q.dtype)
        o = sdpa(q, k, v, attn_mask=plan.decode_mask, scale=scaling, enable_gqa=gqa)
        out[plan.decode_rows] = o[:, :, 0]
    return out[None], None


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTENTION_NAME, paged_attention)
        _registered = True


@contextlib.contextmanager
def paged_attention_of(model):
    """Within the block, ``model``'s attention reads the paged cache (its own setting is restored after)."""
    _register()
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    try:
        yield
    finally:
        config._attn_implementation = before


def default_cache_bytes(model, max_batch_size: int, context_length: int | None) -> int:
    """Room for ``max_batch_size`` sequences of the whole context (4096 tokens if unknown)."""
    layers, kv_heads, head_dim = model_kv_shape(model.config)
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, next(model.parameters()).dtype)
    return per_token * max_batch_size * (context_length or 4096)


__all__ += ["PagedCache", "paged_attention", "paged_attention_of", "default_cache_bytes"]
