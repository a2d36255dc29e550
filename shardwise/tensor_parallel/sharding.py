"""How a tensor-parallel layer's parameter is cut over the tensor ranks: one sharding spec for every AutoTP
layer (``autotp_layers``, and DeepSpeed's ``deepspeed.module_inject.layers`` names in the compat package).

A ``ShardSpec`` describes one dimension of a tensor: it holds ``sizes`` sub-parameters stacked along
``dim`` (one for a plain weight; q, k and v for a fused projection, of equal or of different sizes), and
each sub-parameter is cut into per-rank ``widths``. Rank ``r``'s piece is its slice of every
sub-parameter, concatenated, so a fused q/k/v stays aligned head by head. The widths may be unequal (a
vocabulary of 101 over 2 ranks: 51 and 50); ``ShardSpec.even`` is the common case of equal pieces.

``shard_widths`` picks the widths as DeepSpeed's AutoTP does: whole key/value heads where the model's head
count divides the dimension (attention projections), else near-even pieces in multiples of a grain, the
remainder on the last rank. ``subparam_layout`` reads a view spec such as ``(3, -1)`` (three equal
sub-parameters) or ``((q, k, v), -1)`` off a ``[out, in]`` weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwise import comm

__all__ = ["HeadCounts", "ShardSpec", "shard_width", "shard_widths", "subparam_layout"]

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
class HeadCounts:
    """A model's head counts and grain, which decide where its layers are cut."""

    num_kv_heads: int | None = None
    num_attention_heads: int | None = None
    n_embd: int | None = None
    tp_grain_size: int = 1

    @classmethod
    def from_model_config(cls, model_config, tp_grain_size: int = 1) -> HeadCounts:
        if model_config is None:
            return cls(tp_grain_size=tp_grain_size)
        config = getattr(model_config, "text_config", None) or model_config
        return cls(num_kv_heads=_first_attr(config, _KV_HEAD_ATTRS),
                   num_attention_heads=_first_attr(config, _ATTN_HEAD_ATTRS),
                   n_embd=_first_attr(config, ("n_embd", "hidden_size")), tp_grain_size=tp_grain_size)


def _by_heads(total_size: int, heads: HeadCounts, name) -> bool:
    text = str(name)
    return (heads.num_kv_heads is not None and total_size % heads.num_kv_heads == 0 and "mlp" not in text
            and text not in _LAST_LINEAR and not any(s in text for s in _MLP_NAMES))


def shard_width(total_size: int, world: int, rank: int, heads: HeadCounts | None = None, name=None) -> int:
    """The width of tensor rank ``rank``'s piece of a dimension of ``total_size`` (layer ``name``)."""
    heads = heads or HeadCounts()
    if _by_heads(total_size, heads, name):
        count = heads.num_kv_heads // world + (1 if rank < heads.num_kv_heads % world else 0)
        return total_size * count // heads.num_kv_heads
    grain = heads.tp_grain_size
    if total_size < grain:
        return total_size // world + (1 if rank < total_size % world else 0)
    grains, tail = divmod(total_size, grain)
    size = (grains // world + (1 if rank < grains % world else 0)) * grain
    return size + tail if rank == world - 1 else size


def shard_widths(total_size: int, world: int, heads: HeadCounts | None = None, name=None) -> list[int]:
    """The width of every tensor rank's piece of a dimension of ``total_size``; they add up to it."""
    sizes = [shard_width(total_size, world, rank, heads, name) for rank in range(world)]
    if sum(sizes) != total_size:
        raise ValueError(f"AutoTP: the pieces {sizes} of layer '{name}' do not add up to its dimension {total_size} "
                         f"(tp_size={world}, {heads})")
    return sizes


@dataclass(frozen=True)
class ShardSpec:
    """Dimension ``dim`` holds sub-parameters of ``sizes``; sub-parameter ``i`` is cut into ``widths[i]``
    (one width per tensor rank)."""

    dim: int
    sizes: tuple[int, ...]
    widths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if len(self.widths) != len(self.sizes) or len({len(w) for w in self.widths}) > 1 \
                or any(sum(w) != s for s, w in zip(self.sizes, self.widths)):
            raise ValueError(f"AutoTP: shard widths {[list(w) for w in self.widths]} do not tile sub-parameters "
                             f"{list(self.sizes)} over the tensor ranks")

    @classmethod
    def even(cls, full: int, world: int, dim: int, parts: int = 1, what: str = "a parameter") -> ShardSpec:
        """``parts`` equal sub-parameters, each cut into ``world`` equal pieces."""
        if full % (parts * world):
            fused = f" ({parts} fused blocks of {full // parts})" if parts > 1 else ""
            raise ValueError(f"AutoTP cannot split {what}: dimension {dim} has {full} features{fused}, "
                             f"not divisible by the tensor-parallel size {world}")
        return cls(dim, (full // parts, ) * parts, ((full // parts // world, ) * world, ) * parts)

    @classmethod
    def of(cls, sizes, world: int, dim: int, heads: HeadCounts | None = None, name=None) -> ShardSpec:
        """Sub-parameters ``sizes``, each cut by ``shard_widths`` (head- and grain-aware)."""
        sizes = tuple(sizes)
        return cls(dim, sizes, tuple(tuple(shard_widths(s, world, heads, name)) for s in sizes))

    @property
    def world(self) -> int:
        return len(self.widths[0])

    @property
    def stride(self) -> int:
        """How many sub-parameters a rank's piece holds a slice of (Megatron's ``partition_stride``)."""
        return len(self.sizes)

    @property
    def is_even(self) -> bool:
        """Equal sub-parameters, each cut into equal pieces (what Megatron's strided layout describes)."""
        return len(set(self.sizes)) == 1 and all(min(w) == max(w) for w in self.widths)

    def local(self, rank: int) -> list[int]:
        """Rank ``rank``'s width of each sub-parameter."""
        return [w[rank] for w in self.widths]

    def cut(self, tensor: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of the whole ``tensor`` (a new, contiguous tensor)."""
        if tensor.shape[self.dim] != sum(self.sizes):
            raise ValueError(f"AutoTP: dimension {self.dim} of a tensor of shape {tuple(tensor.shape)} is not the "
                             f"{sum(self.sizes)} features this spec cuts")
        subs = tensor.split(self.sizes, dim=self.dim)
        pieces = [sub.split(w, dim=self.dim)[rank] for sub, w in zip(subs, self.widths)]
        return torch.cat(pieces, dim=self.dim).contiguous() if len(pieces) > 1 else pieces[0].contiguous().clone()

    def gather(self, piece: torch.Tensor, group) -> torch.Tensor:
        """The whole tensor from every rank's ``piece`` (collective over ``group``; inverse of ``cut``)."""
        local = self.local(comm.get_rank(group))
        if piece.shape[self.dim] != sum(local):
            raise ValueError(f"AutoTP: dimension {self.dim} of a piece of shape {tuple(piece.shape)} is not this "
                             f"rank's {sum(local)} features")
        parts = piece.split(local, dim=self.dim)
        return torch.cat([_all_gather_uneven(p, self.dim, group, w) for p, w in zip(parts, self.widths)],
                         dim=self.dim)


def _all_gather_uneven(tensor: torch.Tensor, dim: int, group, widths) -> torch.Tensor:
    """Rank pieces of ``widths`` along ``dim``, concatenated (zero padded to one width for the collective)."""
    world = len(widths)
    shape = list(tensor.shape)
    shape[dim] = max(widths)
    padded = tensor.new_zeros(shape)
    padded.narrow(dim, 0, tensor.shape[dim]).copy_(tensor)
    moved = padded.movedim(dim, 0).contiguous()
    out = moved.new_empty((world * moved.shape[0], *moved.shape[1:]))
    comm.all_gather_into_tensor(out, moved, group=group)
    return torch.cat([p.narrow(0, 0, w) for p, w in zip(out.chunk(world, dim=0), widths)], dim=0).movedim(0, dim)


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _as_spec(shape):
    if isinstance(shape, (list, tuple)):
        return tuple(_as_spec(s) if isinstance(s, list) else s for s in shape)
    return shape


def subparam_layout(weight_shape, shape, partition_dim: int, name=None):
    """``shape`` views the ``[out, in]`` weight as a tensor whose ``partition_dim`` holds the sub-parameters: an
    int there is their count (equal sizes), a tuple their sizes, -1 one dimension to infer. Returns the logical
    shape, the output part of it, the sub-parameter sizes (None: the dimension is one) and the bias's partition
    dimension (None: the bias is replicated)."""
    label = f"AutoTP layer '{name}'" if name else "AutoTP layer"
    weight_shape = tuple(weight_shape)
    shape = _as_spec(shape)
    if not isinstance(shape, tuple):
        raise ValueError(f"{label}: shape must be a tuple, got {shape!r}")
    if not 0 <= partition_dim < len(shape):
        raise ValueError(f"{label}: partition_dim {partition_dim} is out of range for shape {shape}")
    elem, sizes, count = shape[partition_dim], None, None
    dims = []
    for i, d in enumerate(shape):
        if i == partition_dim:
            if isinstance(elem, tuple):
                if not elem or any(not isinstance(v, int) or v <= 0 for v in elem):
                    raise ValueError(f"{label}: sub-parameter sizes must be positive integers, got {elem}")
                sizes = tuple(elem)
                dims.append(sum(sizes))
            elif isinstance(elem, int) and (elem == -1 or elem > 0):
                count = elem if elem > 0 else None
                dims.append(None)
            else:
                raise ValueError(f"{label}: the partition_dim entry must be a positive int, -1 or a tuple, "
                                 f"got {elem!r}")
        elif isinstance(d, int) and (d == -1 or d > 0):
            dims.append(None if d == -1 else d)
        else:
            raise ValueError(f"{label}: shape dimensions must be positive integers or -1, got {d!r}")
    numel = _prod(weight_shape)
    unknown = [i for i, d in enumerate(dims) if d is None]
    known = _prod(d for d in dims if d is not None)
    if len(unknown) == 1:
        dims[unknown[0]] = numel // known
    elif len(unknown) > 1 and len(shape) == len(weight_shape):
        for i in unknown:
            dims[i] = weight_shape[i]
    elif unknown:
        raise ValueError(f"{label}: shape {shape} leaves several dimensions to infer")
    logical = tuple(dims)
    if _prod(logical) != numel:
        raise ValueError(f"{label}: shape {shape} does not match the weight {weight_shape}")
    if logical[-1] != weight_shape[-1]:
        raise ValueError(f"{label}: the last dimension of shape {logical} must be the weight's input size "
                         f"{weight_shape[-1]}")
    output = logical[:-1]
    if not output or _prod(output) != weight_shape[0]:
        raise ValueError(f"{label}: shape {logical} does not describe the weight's {weight_shape[0]} outputs")
    if count is not None:
        if logical[partition_dim] % count:
            raise ValueError(f"{label}: dimension {partition_dim} ({logical[partition_dim]}) does not divide into "
                             f"{count} sub-parameters")
        sizes = (logical[partition_dim] // count, ) * count
    return logical, output, sizes, partition_dim if partition_dim < len(output) else None
