"""``deepspeed.utils.logging``: the ``shardwise`` logger and rank-filtered logging."""

from __future__ import annotations

import functools
import json
import logging
import os
import sys

logger = logging.getLogger("shardwise")

_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


class _DefaultHandler(logging.StreamHandler):
    """Prints shardwise's records on standard output (as DeepSpeed's logger does, so that
    ``steps_per_print`` and ``log_dist`` are seen in a plain script) only while the application has
    not configured logging itself: once the root logger has a handler, records go there alone."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(_FORMAT))

    @property
    def stream(self):  # the current sys.stdout, even if it was replaced after import
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def _install_default_handler() -> None:
    if not any(isinstance(h, _DefaultHandler) for h in logger.handlers):
        logger.addHandler(_DefaultHandler())
    if logger.level == logging.NOTSET:
        level = os.environ.get("SHARDWISE_LOG_LEVEL", "info")
        logger.setLevel(_LEVELS.get(level.lower(), logging.INFO))

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}


_install_default_handler()


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
        logger.log(level, text, stacklevel=2)


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
