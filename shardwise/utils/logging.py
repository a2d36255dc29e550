"""``deepspeed.utils.logging``: the ``shardwise`` logger and rank-filtered logging."""

from __future__ import annotations

import functools
import json
import logging
import os

logger = logging.getLogger("shardwise")

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


def _rank() -> int:
    from shardwise import comm

    return comm.get_rank() if comm.is_initialized() else -1


def get_dist_msg(message, ranks=None):
    """``"[Rank r] message"`` if this rank should log it (no process group yet, ``r`` in ``ranks``
    or ``ranks == [-1]``), else None — DeepSpeed's rule."""
    rank = _rank()
    should = rank == -1 or (bool(ranks) and (ranks[0] == -1 or rank in set(ranks)))
    return f"[Rank {rank}] {message}" if should else None


def log_dist(message, ranks=None, level=logging.INFO):
    """Log ``message`` on the ranks listed in ``ranks`` (``[-1]``: all ranks)."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        logger.log(level, text)


@functools.lru_cache(None)
def _log_once(message, ranks_key, level):
    log_dist(message, list(ranks_key) if ranks_key is not None else None, level)


def log_dist_once(message, ranks=None, level=logging.INFO):
    _log_once(message, tuple(ranks) if ranks is not None else None, level)


def print_json_dist(message, ranks=None, path=None):
    """Write ``message`` (a dict) as JSON to ``path`` on the ranks listed in ``ranks``."""
    if get_dist_msg("", ranks) is None:
        return
    message = dict(message, rank=_rank())
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(message, f)


def get_log_level_from_string(log_level_str):
    try:
        return _LEVELS[str(log_level_str).lower()]
    except KeyError:
        raise ValueError(f"log level {log_level_str!r}: expected one of {', '.join(_LEVELS)}") from None


def set_log_level_from_string(log_level_str, custom_logger=None):
    (custom_logger or logger).setLevel(get_log_level_from_string(log_level_str))
