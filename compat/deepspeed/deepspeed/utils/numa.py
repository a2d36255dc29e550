"""``deepspeed.utils.numa``: the core-list syntax of ``--bind_core_list`` (shardwise.launcher.ds_flags)."""
from shardwise.launcher.ds_flags import parse_core_list


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-5,8"`` -> ``[0, 2, 3, 4, 5, 8]``; ValueError for a malformed or repeated core."""
    return parse_core_list(range_str)


__all__ = ["parse_range_list"]
