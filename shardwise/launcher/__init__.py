"""``shardwise run``: start training processes through torch's elastic agent, on this
machine or, with a hostfile, on several (see docs/launcher.md).

Importing this package does not import torch; :func:`run` does, when called.
"""
from .options import LaunchOptions, add_run_arguments, options_from_args, validate

__all__ = ["LaunchOptions", "add_run_arguments", "options_from_args", "validate", "run"]


def run(opts: LaunchOptions, **kwargs) -> int:
    """Launch ``opts.script``; return the exit code. Raises ValueError for bad options.

    * ``--no_ssh`` (or started by the fan-out): this node's share of a multi-node job;
    * a hostfile with several hosts (or ``--force_multi``): one node agent per host;
    * otherwise: processes on this machine only.
    """
    from . import hostfile, local

    validate(opts)
    if opts.ft_replicas is not None:  # replica groups on torchft (shardwise/ft/launch.py)
        from shardwise.ft.launch import run_replica_groups

        return run_replica_groups(opts, **kwargs)
    if opts.world_info is not None:
        from .runners import decode_world_info

        hosts = decode_world_info(opts.world_info)
    else:
        hosts = hostfile.resolve(hostfile=opts.hostfile, include=opts.include,
                                 exclude=opts.exclude, num_nodes=opts.num_nodes,
                                 num_gpus=opts.num_procs)
    if opts.no_ssh:
        return local.run(opts, hosts=hosts, **kwargs)
    if hosts is None:
        if opts.num_nodes is not None and opts.num_nodes > 1:
            raise ValueError(f"--num_nodes {opts.num_nodes} needs a --hostfile naming the hosts")
        return local.run(opts, slots=_local_slots(opts), **kwargs)
    if len(hosts) == 1 and not opts.force_multi:
        (slots,) = hosts.values()  # one host: run here, as DeepSpeed does
        return local.run(opts, slots=slots, **kwargs)
    from . import multinode

    return multinode.run(opts, hosts, **kwargs)


def _local_slots(opts: LaunchOptions) -> list[int] | None:
    """``--include localhost:0,1`` / ``--exclude localhost:1`` without a hostfile."""
    if not (opts.include or opts.exclude):
        return None
    from . import hostfile
    from .options import count_accelerators

    available = opts.num_procs or count_accelerators()[0] or 1
    hosts = hostfile.apply_filters({"localhost": list(range(available))}, include=opts.include,
                                   exclude=opts.exclude)
    return hosts["localhost"]
