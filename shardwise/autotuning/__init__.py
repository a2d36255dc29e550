"""Autotuning: ``shardwise autotune`` picks the ZeRO stage and micro-batch size that train fastest.

The engine side (measuring a trial and writing its metrics) is ``recorder``; the search is
``autotuner`` (driver), ``space`` (candidates and memory pruning), ``tuners`` (search order),
``runner`` (one trial = one ``shardwise run``) and ``results`` (what is written at the end).
"""

from __future__ import annotations

__all__ = ["run"]


def run(ns) -> int:
    """Entry point of ``shardwise autotune`` (``ns``: the parsed launcher flags plus ``trial_timeout``)."""
    import logging

    from shardwise.launcher.options import count_accelerators, options_from_args, resolve_num_procs, validate

    from .autotuner import Autotuner
    from .results import write_results

    if not logging.getLogger("shardwise").handlers and not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    opts = options_from_args(ns)
    validate(opts)
    n, kind = count_accelerators()
    tuner = Autotuner(opts, num_procs=resolve_num_procs(opts.num_procs, accelerators=n, kind=kind),
                      trial_timeout=ns.trial_timeout)
    best = tuner.tune()
    print(write_results(tuner, best), flush=True)
    return 0 if best is not None else 1
