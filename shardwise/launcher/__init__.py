"""``shardwise run``: start local training processes through torch's elastic agent.

Importing this package does not import torch; :func:`run` does, when called.
"""
from .options import LaunchOptions, add_run_arguments, options_from_args, validate

__all__ = ["LaunchOptions", "add_run_arguments", "options_from_args", "validate", "run"]


def run(opts: LaunchOptions, **kwargs) -> int:
    """Launch ``opts.script`` on the local processes; return the exit code (see local.run)."""
    from .local import run as _run

    return _run(opts, **kwargs)
