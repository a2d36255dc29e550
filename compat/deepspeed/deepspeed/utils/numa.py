"""``deepspeed.utils.numa``: the core-list syntax of ``--bind_core_list`` (shardwise.launcher.ds_flags)."""
from shardwise.launcher.ds_flags import parse_core_list


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-5,8"`` -> ``[0, 2, 3, 4, 5, 8]``; ValueError for a malformed or repeated core, a range written
    backwards, or (DeepSpeed's rule for this function) ranges not in ascending order."""
    cores = parse_core_list(range_str)
    if cores != sorted(cores):
        raise ValueError(f"{range_str!r}: the ranges must be in ascending order and must not overlap")
    return cores


__all__ = ["parse_range_list"]
