"""``shardwise run --ft_replicas R``: replica groups on torchft (docs/fault-tolerance.md).

* ``--ft_replicas R`` alone: start torchft's lighthouse in this launcher, then one launcher per replica
  group (``shardwise run --ft_lighthouse HOST:PORT --ft_replica_id I``, each on its own rendezvous port,
  so each replica group is its own torch.distributed world) and wait for them. A replica group whose
  process dies is restarted alone, by its own launcher, up to ``--max_restarts`` times; the others go on.
* ``--ft_lighthouse HOST:PORT --ft_replica_id I --ft_replicas R``: this launcher runs replica group I of
  a job whose lighthouse runs elsewhere (one launcher per node under Slurm or Kubernetes).

The processes of replica group I see ``REPLICA_GROUP_ID=I``, ``NUM_REPLICA_GROUPS=R`` and
``TORCHFT_LIGHTHOUSE`` (torchft's names).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from typing import TextIO

from . import LIGHTHOUSE_ENV, NUM_REPLICA_GROUPS, REPLICA_GROUP_ID


def _say(out: TextIO, msg: str) -> None:
    print(f"[shardwise ft] {msg}", file=out, flush=True)


def run_replica_groups(opts, *, out: TextIO | None = None, **kwargs) -> int:
    out = out or sys.stderr
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse and managers log every quorum at info
    _require_torchft()
    if opts.ft_lighthouse is not None:
        return _run_one_group(opts, out=out)
    return _run_all_groups(opts, out=out)


def _require_torchft() -> None:
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise ValueError("--ft_replicas/--ft_lighthouse need torchft, which is not installed: "
                         "pip install shardwise[ft]") from None


def _run_one_group(opts, *, out: TextIO) -> int:
    from shardwise.launcher import local

    address = opts.ft_lighthouse if "://" in opts.ft_lighthouse else f"http://{opts.ft_lighthouse}"
    env = {REPLICA_GROUP_ID: str(opts.ft_replica_id), NUM_REPLICA_GROUPS: str(opts.ft_replicas),
           LIGHTHOUSE_ENV: address}
    group = dataclasses.replace(opts, ft_replicas=None, ft_lighthouse=None, ft_replica_id=None)
    if group.master_port is not None:  # (chosen by the launcher of all groups: taken since? any other will do)
        from shardwise.launcher.options import DEFAULT_MASTER_ADDR, free_port, port_is_free

        addr = group.master_addr or DEFAULT_MASTER_ADDR
        if opts.stop_with_parent and not port_is_free(addr, group.master_port):
            group = dataclasses.replace(group, master_port=free_port(addr))
    with local._environ(env):
        code = local.run(group, out=out)
    if code:
        _say(out, f"replica group {opts.ft_replica_id} failed (exit code {code}) after {opts.max_restarts} restart(s)")
    return code


def _child_argv(opts, replica: int, lighthouse: str, port: int) -> list[str]:
    argv = [sys.executable, "-m", "shardwise", "run", "--master_port", str(port), "--max_restarts",
            str(opts.max_restarts), "--ft_replicas", str(opts.ft_replicas), "--ft_lighthouse", lighthouse,
            "--ft_replica_id", str(replica), "--stop_with_parent"]  # (no replica group outlives this launcher)
    if opts.num_procs is not None:
        argv += ["--num_procs", str(opts.num_procs)]
    if opts.master_addr:
        argv += ["--master_addr", opts.master_addr]
    if opts.comm_timeout is not None:
        argv += ["--comm_timeout", str(opts.comm_timeout)]
    for flag in ("module", "no_python", "no_local_rank", "bind_cores_to_rank"):
        if getattr(opts, flag):
            argv.append(f"--{flag}")
    return argv + [opts.script, *opts.script_args]


def _run_all_groups(opts, *, out: TextIO) -> int:
    from torchft.coordination import LighthouseServer

    from shardwise.launcher.options import DEFAULT_MASTER_ADDR, free_port

    server = LighthouseServer(bind="[::]:0", min_replicas=opts.ft_min_replicas,
                              join_timeout_ms=int(opts.ft_join_timeout * 1000),
                              heartbeat_timeout_ms=int(opts.ft_heartbeat_timeout * 1000))
    lighthouse = server.address().split("://", 1)[-1]
    _say(out, f"lighthouse at {lighthouse} (min_replicas {opts.ft_min_replicas}); starting {opts.ft_replicas} "
         f"replica group(s) of {opts.num_procs or 'one per device'} process(es), up to {opts.max_restarts} restart(s) each")
    addr = opts.master_addr or DEFAULT_MASTER_ADDR
    ports: list[int] = []
    while len(ports) < opts.ft_replicas:
        p = free_port(addr)
        if p not in ports:
            ports.append(p)
    children = [subprocess.Popen(_child_argv(opts, i, lighthouse, ports[i])) for i in range(opts.ft_replicas)]
    codes: list[int | None] = [None] * len(children)
    try:
        while any(c is None for c in codes):
            for i, child in enumerate(children):
                if codes[i] is None and (rc := child.poll()) is not None:
                    codes[i] = rc
                    if rc:
                        _say(out, f"replica group {i} ended with exit code {rc}; the others go on")
            time.sleep(0.2)
    except KeyboardInterrupt:
        for child in children:
            if child.poll() is None:
                child.terminate()
        for child in children:
            child.wait()
        return 130
    finally:
        server.shutdown()
    failed = [(i, c) for i, c in enumerate(codes) if c]
    if failed:
        _say(out, "failed replica group(s): " + ", ".join(f"{i} (exit code {c})" for i, c in failed))
        return failed[0][1]
    return 0
