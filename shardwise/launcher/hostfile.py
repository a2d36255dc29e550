"""Which hosts and slots a launch uses: the hostfile, ``--include``/``--exclude``,
``--num_nodes`` and ``--num_gpus``, with DeepSpeed's formats and rules.

A hostfile has one ``hostname slots=N`` per line; ``#`` starts a comment; blank lines
are skipped. A filter is ``host1:0,1@host2``: slots 0 and 1 of host1 and every slot of
host2. Resources are an ordered ``{host: [slot ids]}``; the first host is node 0.
"""
from __future__ import annotations

import os
import re

__all__ = ["DEFAULT_HOSTFILE", "parse_hostfile", "read_hostfile", "apply_filters", "select"]

DEFAULT_HOSTFILE = "/job/hostfile"  # DeepSpeed's default location
_LINE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\S+))?(?P<rest>.*)$")

Resources = dict[str, list[int]]


def parse_hostfile(text: str, *, source: str = "hostfile") -> Resources:
    """``{host: [0..slots-1]}`` in file order; ValueError naming ``source:line`` on a bad line."""
    hosts: Resources = {}
    first_seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        m = _LINE.match(line)
        if m is None or m.group("slots") is None or m.group("rest").strip():
            raise ValueError(f"{where}: expected 'hostname slots=N', got {raw.strip()!r}")
        host, slots = m.group("host"), m.group("slots")
        if not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"{where}: slots must be a positive integer, got {slots!r} "
                             f"in {raw.strip()!r}")
        if host in hosts:
            raise ValueError(f"{where}: host {host!r} is listed twice (first on line "
                             f"{first_seen[host]})")
        hosts[host] = list(range(int(slots)))
        first_seen[host] = lineno
    if not hosts:
        raise ValueError(f"{source}: no hosts listed (expected lines 'hostname slots=N')")
    return hosts


def read_hostfile(path: str) -> Resources:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"--hostfile {path}: cannot read it ({exc.strerror})") from None
    return parse_hostfile(text, source=path)


def _parse_filter(spec: str, hosts: Resources, flag: str) -> Resources:
    wanted: Resources = {}
    for part in spec.split("@"):
        part = part.strip()
        if not part:
            raise ValueError(f"{flag} {spec!r}: empty entry between '@' separators")
        host, _, slot_text = part.partition(":")
        if host not in hosts:
            known = ", ".join(hosts)
            raise ValueError(f"{flag} {spec!r}: unknown host {host!r} (the hostfile lists {known})")
        if not slot_text:
            wanted[host] = list(hosts[host])
            continue
        slots = []
        for s in slot_text.split(","):
            if not s.strip().isdigit():
                raise ValueError(f"{flag} {spec!r}: slot {s!r} of host {host!r} is not a number")
            slot = int(s)
            if slot not in hosts[host]:
                raise ValueError(f"{flag} {spec!r}: host {host!r} has slots 0-{len(hosts[host]) - 1}"
                                 f" (slots={len(hosts[host])}), no slot {slot}")
            slots.append(slot)
        wanted.setdefault(host, [])
        wanted[host] = sorted(set(wanted[host]) | set(slots))
    return wanted


def apply_filters(hosts: Resources, *, include: str = "", exclude: str = "") -> Resources:
    """Keep what ``include`` names, or drop what ``exclude`` names (not both)."""
    if include and exclude:
        raise ValueError("--include and --exclude cannot be combined")
    if include:
        chosen = _parse_filter(include, hosts, "--include")
        return {h: chosen[h] for h in hosts if h in chosen}
    if exclude:
        dropped = _parse_filter(exclude, hosts, "--exclude")
        kept = {h: [s for s in slots if s not in dropped.get(h, [])] for h, slots in hosts.items()}
        kept = {h: s for h, s in kept.items() if s}
        if not kept:
            raise ValueError(f"--exclude {exclude!r} leaves no host to run on")
        return kept
    return dict(hosts)


def select(hosts: Resources, *, num_nodes: int | None = None,
           num_gpus: int | None = None) -> Resources:
    """The first ``num_nodes`` hosts, each with its first ``num_gpus`` slots."""
    if num_nodes is not None:
        if num_nodes < 1:
            raise ValueError(f"--num_nodes must be at least 1, got {num_nodes}")
        if num_nodes > len(hosts):
            raise ValueError(f"--num_nodes {num_nodes} asks for more hosts than the "
                             f"{len(hosts)} available ({', '.join(hosts)})")
        hosts = dict(list(hosts.items())[:num_nodes])
    if num_gpus is not None:
        short = [f"{h} (slots={len(s)})" for h, s in hosts.items() if len(s) < num_gpus]
        if short:
            raise ValueError(f"--num_gpus {num_gpus} is more than the slots of "
                             f"{', '.join(short)}")
        hosts = {h: s[:num_gpus] for h, s in hosts.items()}
    return hosts


def resolve(*, hostfile: str | None, include: str = "", exclude: str = "",
            num_nodes: int | None = None, num_gpus: int | None = None) -> Resources | None:
    """The hosts of a launch, or None for a plain local launch (no hostfile anywhere)."""
    if hostfile is None:
        if not os.path.isfile(DEFAULT_HOSTFILE):
            return None
        hostfile = DEFAULT_HOSTFILE
    hosts = apply_filters(read_hostfile(hostfile), include=include, exclude=exclude)
    return select(hosts, num_nodes=num_nodes, num_gpus=num_gpus)
