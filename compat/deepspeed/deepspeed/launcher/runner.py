"""``deepspeed.launcher.runner``: the names other tools and DeepSpeed's tests take from DeepSpeed's
launcher module, on shardwise's launcher (``shardwise run``, ``shardwise.launcher.hostfile``).

accelerate's ``accelerate launch --use_deepspeed`` reads ``DEEPSPEED_ENVIRONMENT_NAME`` (the file of
``KEY=VALUE`` lines exported to every node, which ``shardwise run`` reads too).
"""
from __future__ import annotations

import base64
import json
from collections import OrderedDict

from shardwise.launcher import hostfile as _hostfile
from shardwise.launcher.environment import ENV_FILE_NAMES

DEEPSPEED_ENVIRONMENT_NAME = ENV_FILE_NAMES[0]  # ".deepspeed_env"
DLTS_HOSTFILE = "/job/hostfile"


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
    filters at once, an unknown host or slot (shardwise.launcher.hostfile.apply_filters)."""
    kept = _hostfile.apply_filters(dict(host_info), include=include_str, exclude=exclude_str)
    return OrderedDict(kept)


def main(args=None) -> int:
    """``deepspeed ARGS`` as a function: ``shardwise run ARGS``. As DeepSpeed's ``main``, a mistake in the
    arguments raises ``ValueError`` (the ``deepspeed`` command prints it and exits 2 instead)."""
    from shardwise.cli import build_parser

    import sys

    ns = build_parser().parse_args(["run", *(sys.argv[1:] if args is None else args)])
    return ns.handler(ns)
