"""``deepspeed.module_inject.tp_shard``: how DeepSpeed's AutoTP cuts a dimension over the tensor ranks.

``get_shard_size_list(total, tp, meta, name)`` is the width of each rank's piece: whole key/value heads
when the model's head count divides the dimension (attention projections), else near-even pieces in
multiples of ``meta.tp_grain_size`` with the remainder on the last rank. The pieces may be unequal
(a vocabulary of 101 over 2 ranks: 51 and 50); shardwise's own AutoTP refuses an uneven split, and the
layers of ``deepspeed.module_inject.layers`` refuse to materialise one (see there).
"""

from __future__ import annotations

from dataclasses import dataclass

_KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
                  "num_attention_heads", "n_heads", "attention_heads")
_ATTN_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
_LAST_LINEAR = ("lm_head", "embed_out")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _first_attr(config, names):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


@dataclass(frozen=True)
class AutoTPMeta:
    """A model's head counts and grain, which decide where its layers are cut."""

    num_kv_heads: int | None = None
    num_attention_heads: int | None = None
    n_embd: int | None = None
    tp_grain_size: int = 1

    @classmethod
    def from_model_config(cls, model_config, tp_grain_size: int = 1) -> AutoTPMeta:
        if model_config is None:
            return cls(tp_grain_size=tp_grain_size)
        config = getattr(model_config, "text_config", None) or model_config
        n_embd = _first_attr(config, ("n_embd", "hidden_size"))
        return cls(num_kv_heads=_first_attr(config, _KV_HEAD_ATTRS),
                   num_attention_heads=_first_attr(config, _ATTN_HEAD_ATTRS), n_embd=n_embd,
                   tp_grain_size=tp_grain_size)


def _by_heads(total_size: int, meta: AutoTPMeta, name) -> bool:
    text = str(name)
    return (meta.num_kv_heads is not None and total_size % meta.num_kv_heads == 0 and "mlp" not in text
            and text not in _LAST_LINEAR and not any(s in text for s in _MLP_NAMES))


def get_shard_size(total_size: int, mp_size: int, meta: AutoTPMeta | None = None, name=None, rank=None,
                   mp_group=None) -> int:
    """The width of tensor rank ``rank``'s piece (``rank`` within the group; default: this process's)."""
    meta = meta or AutoTPMeta()
    if rank is None:
        from shardwise import comm
        if mp_group is None and comm.get_world_size() != mp_size:
            raise ValueError(f"get_shard_size: pass rank= or mp_group= when mp_size ({mp_size}) is not the world "
                             f"size ({comm.get_world_size()})")
        rank = comm.get_rank(mp_group)
    if _by_heads(total_size, meta, name):
        heads = meta.num_kv_heads // mp_size + (1 if rank < meta.num_kv_heads % mp_size else 0)
        return total_size * heads // meta.num_kv_heads
    grain = meta.tp_grain_size
    if total_size < grain:
        return total_size // mp_size + (1 if rank < total_size % mp_size else 0)
    grains, tail = divmod(total_size, grain)
    size = (grains // mp_size + (1 if rank < grains % mp_size else 0)) * grain
    return size + tail if rank == mp_size - 1 else size


def get_shard_size_list(total_size: int, mp_size: int, meta: AutoTPMeta | None = None, name=None) -> list[int]:
    """The width of every tensor rank's piece of a dimension of ``total_size``; they add up to it."""
    sizes = [get_shard_size(total_size, mp_size, meta, name, rank) for rank in range(mp_size)]
    if sum(sizes) != total_size:
        raise ValueError(f"AutoTP: the pieces {sizes} of layer '{name}' do not add up to its dimension {total_size} "
                         f"(tp_size={mp_size}, {meta})")
    return sizes
