"""``deepspeed.launcher.runner``: the names other tools and DeepSpeed's tests take from DeepSpeed's
launcher module, on shardwise's launcher (``shardwise run``, ``shardwise.launcher.hostfile``).

accelerate's ``accelerate launch --use_deepspeed`` reads ``DEEPSPEED_ENVIRONMENT_NAME`` (the file of
``KEY=VALUE`` lines exported to every node, which ``shardwise run`` reads too).
"""
from __future__ import annotations

import argparse
import base64
import json
from collections import OrderedDict

from shardwise.launcher import hostfile as _hostfile
from shardwise.launcher.environment import ENV_FILE_NAMES

DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE_NAMES[0]  # ".deepspeed_env"
DLTS_HOSTFILE = "/job/hostfile"
PDSH_LAUNCHER = "pdsh"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


def parse_args(args=None) -> argparse.Namespace:
    """DeepSpeed's ``deepspeed`` command line as a namespace, with DeepSpeed's attribute names and defaults
    (``user_script``, ``user_args``, ``num_gpus=-1``, ``launcher="pdsh"``, ...): what code that builds
    DeepSpeed's runners (``multinode_runner.PDSHRunner(args, world_info)``) reads. ``shardwise run`` takes the
    same flags."""
    p = argparse.ArgumentParser(prog="deepspeed", description="launch a multi-node / multi-process job "
                                "(shardwise run)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-H", "--hostfile", type=str, default=DLTS_HOSTFILE, help="hostfile: 'hostname slots=N' lines")
    p.add_argument("-i", "--include", type=str, default="", help="hosts/slots to use: NAME[:SLOT[,SLOT]]@...")
    p.add_argument("-e", "--exclude", type=str, default="", help="hosts/slots not to use (same format)")
    p.add_argument("--num_nodes", type=int, default=-1, help="number of nodes to use (-1: all)")
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1, help="processes per node (-1: all)")
    p.add_argument("--master_port", type=int, default=TORCH_DISTRIBUTED_DEFAULT_PORT, help="rendezvous port")
    p.add_argument("--master_addr", type=str, default="", help="rendezvous address (default: the first host)")
    p.add_argument("--node_rank", type=int, default=-1, help="this node's rank with --no_ssh")
    p.add_argument("--launcher", type=str, default=PDSH_LAUNCHER,
                   help="multi-node backend: pdsh, openmpi, mpich, impi, mvapich, slurm")
    p.add_argument("--launcher_args", type=str, default="", help="arguments passed to the backend's command")
    p.add_argument("--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("--no_python", action="store_true", help="run the script as a program")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank to the script")
    p.add_argument("--no_ssh", action="store_true", help="launch this node only (every node runs the command)")
    p.add_argument("--no_ssh_check", action="store_true", help="skip the ssh checks of the hosts")
    p.add_argument("--force_multi", action="store_true", help="multi-node launch even for one node")
    p.add_argument("--save_pid", action="store_true", help="write the launcher's pid to a file")
    p.add_argument("--enable_each_rank_log", type=str, default="None", help="directory of one log per rank")
    p.add_argument("--autotuning", type=str, default="", choices=["tune", "run"], help="autotune first")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="bind each rank to its share of cores")
    p.add_argument("--bind_core_list", type=str, default=None, help="cores to split between ranks, e.g. 0,2-5")
    p.add_argument("--ssh_port", type=int, default=None, help="ssh port of the hosts")
    p.add_argument("--venv_script", type=str, default=None, help="script every worker sources first")
    p.add_argument("--log_level", type=str, default="info",
                   choices=["debug", "info", "warning", "error", "critical"], help="the launcher's log level")
    p.add_argument("-q", "--quiet", action="store_true", help="log errors only")
    p.add_argument("user_script", type=str, help="the training script, then its arguments")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p.parse_args(args=args)


def encode_world_info(world_info) -> str:
    """DeepSpeed's launcher's ``--world_info`` argument: ``{host: [slots]}`` as JSON in URL-safe base64.
    (``shardwise run`` hands its node agents its own value, the ``(host, slots)`` pairs in order.)"""
    return base64.urlsafe_b64encode(json.dumps(world_info).encode("utf-8")).decode("utf-8")


def _parse_hostfile(hostfile_lines) -> OrderedDict:
    """``{host: slots}`` of hostfile lines ("hostname slots=N"); ValueError on a bad, repeated or
    missing host line (shardwise.launcher.hostfile.parse_hostfile)."""
    hosts = _hostfile.parse_hostfile("\n".join(hostfile_lines))
    return OrderedDict((host, len(slots)) for host, slots in hosts.items())


def fetch_hostfile(hostfile_path):
    """``{host: slots}`` of the file, or None when it does not exist (DeepSpeed then runs locally)."""
    try:
        with open(hostfile_path) as f:
            return _parse_hostfile(f.readlines())
    except FileNotFoundError:
        return None


def parse_resource_filter(host_info, include_str="", exclude_str=""):
    """``{host: [slots]}`` kept by an include or exclude filter ("host1:0,1@host2"); ValueError for both
    filters at once, an unknown host or slot (shardwise.launcher.hostfile.apply_filters). An exclude filter
    that removes every slot leaves an empty dict, as DeepSpeed's does (the launcher, ``deepspeed`` /
    ``shardwise run``, refuses to start with nothing to run on)."""
    if exclude_str and not include_str:
        dropped = _hostfile._parse_filter(exclude_str, dict(host_info), "--exclude")
        kept = ((h, [s for s in slots if s not in dropped.get(h, [])]) for h, slots in host_info.items())
        return OrderedDict((h, slots) for h, slots in kept if slots)
    kept = _hostfile.apply_filters(dict(host_info), include=include_str, exclude=exclude_str)
    return OrderedDict(kept)


def main(args=None) -> int:
    """``deepspeed ARGS`` as a function: ``shardwise run ARGS``. As DeepSpeed's ``main``, a mistake in the
    arguments raises ``ValueError`` (the ``deepspeed`` command prints it and exits 2 instead)."""
    from shardwise.cli import build_parser

    import sys

    ns = build_parser().parse_args(["run", *(sys.argv[1:] if args is None else args)])
    return ns.handler(ns)
