"""``deepspeed.checkpoint.universal_checkpoint``: cutting this tensor rank's piece of an AutoTP parameter out of
the whole tensor a universal checkpoint holds, from the parameter's ``ds_autotp_universal_checkpoint_meta``
(``deepspeed.module_inject.layers``).

shardwise reads DeepSpeed's universal checkpoints with its own importer (``shardwise.checkpoint.deepspeed_format``)
and reshards its own checkpoints from their manifest; this module gives DeepSpeed's restore helpers for code
that calls them on AutoTP layers. ``load_hp_checkpoint_state`` (DeepSpeed's optimizer hook) is not provided.
"""

from __future__ import annotations

import torch

from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META, UNIVERSAL_CHECKPOINT_VERSION_KEY

__all__ = ["_get_param_uc_restore_meta", "_narrow_sub_params", "_resolve_autotp_partition"]


def _get_param_uc_restore_meta(param):
    return getattr(param, DS_AUTOTP_UC_META, None)


def _narrow_sub_params(full_view, partition_dim, sub_dim_sizes, shard_widths, tp_rank, tp_world_size, uc_version):
    """Rank ``tp_rank``'s slice of every sub-parameter of ``full_view``, concatenated and flattened.

    ``shard_widths`` (one list of per-rank widths per sub-parameter) is recorded from version 0.4 on; older
    metadata can only describe an even split, so an uneven sub-parameter there is refused."""
    sizes = list(sub_dim_sizes)
    if sum(sizes) != full_view.shape[partition_dim]:
        raise ValueError(f"sub-parameter sizes {sizes} add up to {sum(sizes)}, but dimension {partition_dim} of the "
                         f"parameter is {full_view.shape[partition_dim]}: the metadata describes another parameter")
    if uc_version < 0.4:
        uneven = [s for s in sizes if s % tp_world_size]
        if uneven:
            raise ValueError(f"sub-parameters {uneven} do not divide by tp_world_size {tp_world_size} and this "
                             f"metadata (version {uc_version}) records no per-rank widths")
        shard_widths = [[s // tp_world_size] * tp_world_size for s in sizes]
    if len(shard_widths) != len(sizes):
        raise ValueError(f"{len(shard_widths)} lists of shard widths for {len(sizes)} sub-parameters")
    pieces, offset = [], 0
    for size, widths in zip(sizes, shard_widths):
        if len(widths) != tp_world_size or sum(widths) != size:
            raise ValueError(f"shard widths {list(widths)} do not tile a sub-parameter of {size} over "
                             f"{tp_world_size} ranks")
        pieces.append(full_view.narrow(partition_dim, offset + sum(widths[:tp_rank]), widths[tp_rank]))
        offset += size
    return torch.cat(pieces, dim=partition_dim).flatten()


def _resolve_autotp_partition(current_param, ckpt_dict, full_hp_param, tp_rank, tp_world_size, state_key="fp32"):
    """This rank's piece (flattened) of ``full_hp_param`` for ``current_param``, or None when the parameter has
    no AutoTP metadata or it says nothing about a split. A layout the layer could not describe is refused
    (``RuntimeError``) rather than restored as rank-ordered slices."""
    meta = _get_param_uc_restore_meta(current_param)
    if not meta:
        return None
    reason = meta.get("conversion", {}).get("unsupported_reason")
    if reason:
        raise RuntimeError(f"Cannot restore a universal checkpoint into this AutoTP parameter: {reason}")
    dim = meta.get("partition_dim")
    if meta.get("replicated", False):
        return full_hp_param.flatten()
    logical = meta.get("logical_shape")
    if dim is None or logical is None:
        return None
    full = full_hp_param.view(logical)
    sizes = meta.get("sub_param_sizes")
    if sizes is None and meta.get("sub_param_shape") is not None:
        sizes = meta["sub_param_shape"][dim]  # older metadata: the view spec's entry (a count reads as one size)
    if sizes is not None:
        sizes = tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes, )
        return _narrow_sub_params(full, dim, sizes, meta.get("sub_param_shard_widths"), tp_rank, tp_world_size,
                                  meta.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0))
    parts = meta.get("partition_sizes")
    if parts is not None:
        return full.narrow(dim, sum(parts[:tp_rank]), parts[tp_rank]).flatten()
    if full.shape[dim] % tp_world_size:
        raise ValueError(f"dimension {dim} of size {full.shape[dim]} does not divide by tp_world_size "
                         f"{tp_world_size} and the metadata records no partition_sizes")
    return full.chunk(tp_world_size, dim=dim)[tp_rank].flatten()
