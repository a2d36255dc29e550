"""``deepspeed.launcher.multinode_runner``: DeepSpeed's base class for a multi-node launcher backend, which
code written for DeepSpeed subclasses for its own cluster tool: ``exports`` (environment variables for the
remote shell line, quoted when needed), ``user_arguments``, ``name``.

shardwise's launcher builds its pdsh / ssh / slurm / mpi commands itself (``shardwise.launcher.runners``,
``shardwise run --launcher``); DeepSpeed's concrete runner classes (``PDSHRunner``, ...) are not provided.
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod

__all__ = ["MultiNodeRunner"]

_PLAIN = re.compile(r"[\w@%+=:,./-]*")  # needs no quoting in a shell line


def _shell_value(value: str) -> str:
    if _PLAIN.fullmatch(value):
        return value
    return '"' + re.sub(r'(["\\$`])', r"\\\1", value) + '"'


class MultiNodeRunner(ABC):

    def __init__(self, args, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}

    @abstractmethod
    def backend_exists(self):
        """Whether the backend's program is installed."""

    @abstractmethod
    def get_cmd(self, environment, active_resources):
        """The command that starts the job on the nodes."""

    def add_export(self, key: str, var: str) -> None:
        """Export ``key=var`` on the nodes; a value with characters a shell reads specially (spaces,
        parentheses, quotes, ...) is double-quoted, a plain one (a path) is kept as it is."""
        self.exports[key.strip()] = _shell_value(var.strip())

    def parse_user_args(self):
        return self.args.user_args

    @property
    def name(self) -> str:
        return type(self).__name__

    def validate_args(self) -> None:
        """Check ``self.args`` (subclasses)."""

    @classmethod
    def validate_active_resources(cls, active_resources) -> None:
        """Refuse an ``--include``/``--exclude`` result this backend cannot express (subclasses)."""
