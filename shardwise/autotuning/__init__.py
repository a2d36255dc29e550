"""Autotuning: ``shardwise autotune`` picks the ZeRO stage and micro-batch size that train fastest.

The engine side (measuring a trial and writing its metrics) is ``recorder``; the search is
``autotuner`` (driver), ``space`` (candidates and memory pruning), ``tuners`` (search order),
``runner`` (one trial = one ``shardwise run``) and ``results`` (what is written at the end).
"""

from __future__ import annotations

__all__ = ["run", "tune_then_run"]


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


def tune_then_run(ns) -> int:
    """``shardwise run --autotuning tune|run``: hand over to ``shardwise autotune``; with ``run``, then
    train with the best config (the script's ``--deepspeed_config`` pointed at ``ds_config_optimal.json``)."""
    import os

    from shardwise import launcher
    from shardwise.config import load_config

    from .runner import find_config_arg

    mode = ns.autotuning
    ns.autotuning = ""
    if not hasattr(ns, "trial_timeout"):
        ns.trial_timeout = 900.0
    rc = run(ns)
    if mode == "tune" or rc != 0:
        return rc
    index, path = find_config_arg(list(ns.script_args))
    best = os.path.join(load_config(path).autotuning.results_dir, "ds_config_optimal.json")
    args = list(ns.script_args)
    args[index] = best if args[index] == path else args[index].split("=", 1)[0] + "=" + best
    ns.script_args = args
    return launcher.run(launcher.options_from_args(ns))
