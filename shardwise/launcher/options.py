"""What ``shardwise run`` was asked to do, checked before anything is started.

Nothing here imports torch at module import time; device discovery imports it lazily.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import shutil
import socket
from dataclasses import dataclass, field

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500  # torch.distributed's and DeepSpeed's default


@dataclass
class LaunchOptions:
    """Options of ``shardwise run``; field names match the command-line flags."""

    script: str
    script_args: list[str] = field(default_factory=list)
    num_procs: int | None = None  # None: one per accelerator, or 1 without any
    master_addr: str | None = None  # None: 127.0.0.1, or the first host of a hostfile
    master_port: int | None = None  # None: DEFAULT_MASTER_PORT, or a free port if that is busy
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    save_pid: bool = False
    max_restarts: int = 0
    # several nodes (docs/launcher.md "Several nodes")
    hostfile: str | None = None  # None: /job/hostfile if it exists, else a local launch
    include: str = ""
    exclude: str = ""
    num_nodes: int | None = None
    node_rank: int | None = None  # --no_ssh: this node's rank (else from Slurm/MPI variables)
    no_ssh: bool = False
    ssh_port: int | None = None
    launcher: str = "ssh"
    launcher_args: str = ""
    force_multi: bool = False
    bind_cores_to_rank: bool = False
    elastic: str | None = None  # "MIN:MAX" nodes
    comm_timeout: float | None = None  # seconds, exported as SHARDWISE_COMM_TIMEOUT
    skip_doctor: bool = False
    local_addr: str | None = None  # this node's address for the rendezvous (and output prefix)
    slots: str | None = None  # comma-separated device ids of this node (set by the fan-out)
    stop_with_parent: bool = False  # set by the fan-out: stop when the ssh session ends
    world_info: str | None = None  # set by the fan-out: every host and its slots (runners.py)
    # DeepSpeed launcher flags (ds_flags.py)
    enable_each_rank_log: str | None = None  # DIR
    bind_core_list: str | None = None
    venv_script: str | None = None
    # fault tolerance: replica groups on torchft (docs/fault-tolerance.md, shardwise/ft/launch.py)
    ft_replicas: int | None = None  # R replica groups (with ft_lighthouse: how many the job has in all)
    ft_lighthouse: str | None = None  # HOST:PORT of a running lighthouse: this launcher runs one replica group
    ft_replica_id: int | None = None  # which one (with ft_lighthouse)
    ft_min_replicas: int = 1  # the lighthouse this launcher starts: replica groups a quorum needs
    ft_join_timeout: float = 5.0  # seconds it waits for stragglers before forming a quorum without them
    ft_heartbeat_timeout: float = 5.0  # seconds without a heartbeat before a replica group counts as lost


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the flags of ``shardwise run`` on ``parser``."""
    procs = parser.add_mutually_exclusive_group()
    procs.add_argument("--num_gpus", "--num-gpus", dest="num_procs", type=int, default=None,
                       metavar="N", help="processes to start, one per device (default: all "
                       "visible accelerators, or 1 on a CPU-only machine)")
    procs.add_argument("--num_procs", "--num-procs", dest="num_procs", type=int,
                       metavar="N", help="alias of --num_gpus, natural for CPU runs")
    procs.add_argument("--num_accelerators", "--num-accelerators", dest="num_procs", type=int,
                       metavar="N", help="alias of --num_gpus (DeepSpeed's name)")
    parser.add_argument("--master_addr", "--master-addr", default=None, metavar="ADDR",
                        help=f"address node 0 listens on (default {DEFAULT_MASTER_ADDR}, or the "
                        "first host of the hostfile)")
    parser.add_argument("--master_port", "--master-port", type=int, default=None, metavar="PORT",
                        help=f"rendezvous port (default {DEFAULT_MASTER_PORT}; a free port is "
                        "chosen if the default is busy)")
    parser.add_argument("--module", "-m", action="store_true",
                        help="treat SCRIPT as a module name and run it like 'python -m'")
    parser.add_argument("--no_python", "--no-python", action="store_true",
                        help="run SCRIPT as a program directly, without the Python interpreter")
    parser.add_argument("--no_local_rank", "--no-local-rank", action="store_true",
                        help="do not pass --local_rank=<n> to the script (LOCAL_RANK is set anyway)")
    parser.add_argument("--save_pid", "--save-pid", action="store_true",
                        help="write the launcher's pid to <tmpdir>/<pid>.shardwise while it runs")
    parser.add_argument("--max_restarts", "--max-restarts", type=int, default=0, metavar="K",
                        help="restart the whole group up to K times after a failure (default 0)")
    parser.add_argument("--comm_timeout", "--comm-timeout", type=float, default=None,
                        metavar="SECONDS", help="collective timeout: a collective that takes "
                        "longer makes every rank report which collective it was in")
    add_multinode_arguments(parser)
    add_fault_tolerance_arguments(parser)
    from shardwise.launcher.ds_flags import add_deepspeed_arguments

    add_deepspeed_arguments(parser)
    parser.add_argument("script", metavar="SCRIPT",
                        help="training script (or module with --module, program with --no_python)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...",
                        help="arguments passed on to the script")


def add_multinode_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags for several nodes (hostfile, filters, fan-out), as DeepSpeed names them."""
    g = parser.add_argument_group("several nodes")
    g.add_argument("--hostfile", "-H", default=None, metavar="PATH",
                   help="lines 'hostname slots=N' (default /job/hostfile if it exists)")
    filters = g.add_mutually_exclusive_group()
    filters.add_argument("--include", "-i", default="", metavar="SPEC",
                         help="hosts/slots to use, e.g. 'host1:0,1@host2'")
    filters.add_argument("--exclude", "-e", default="", metavar="SPEC",
                         help="hosts/slots to leave out, e.g. 'host1:1@host3'")
    g.add_argument("--num_nodes", "--num-nodes", type=int, default=None, metavar="N",
                   help="use the first N hosts of the hostfile")
    g.add_argument("--node_rank", "--node-rank", type=int, default=None, metavar="N",
                   help="with --no_ssh: this node's rank (default: from SLURM_NODEID, "
                   "OMPI_COMM_WORLD_RANK or PMI_RANK)")
    g.add_argument("--no_ssh", "--no-ssh", action="store_true",
                   help="start only this node's processes; run the same command on every node")
    g.add_argument("--ssh_port", "--ssh-port", type=int, default=None, metavar="PORT",
                   help="ssh port of the hosts (ssh and pdsh launchers)")
    g.add_argument("--launcher", default="ssh", type=str.lower,
                   choices=["ssh", "pdsh", "slurm", "mpi", "openmpi", "mpich", "impi", "mvapich"],
                   help="how to start the node agents (default %(default)s); DeepSpeed's MPI names "
                   "(openmpi, mpich, impi, mvapich) use the mpi runner")
    g.add_argument("--launcher_args", "--launcher-args", default="", metavar="ARGS",
                   help="extra arguments for pdsh, srun or mpirun (one quoted string)")
    g.add_argument("--force_multi", "--force-multi", action="store_true",
                   help="use the multi-node launcher even for a single host")
    g.add_argument("--bind_cores_to_rank", "--bind-cores-to-rank", action="store_true",
                   help="give each local rank its own share of this node's CPU cores")
    g.add_argument("--elastic", default=None, metavar="MIN:MAX",
                   help="elastic number of nodes (c10d rendezvous); implies restarts")
    g.add_argument("--skip_doctor", "--skip-doctor", action="store_true",
                   help="do not run the 'shardwise doctor' checks before a multi-node launch")
    g.add_argument("--local_addr", "--local-addr", default=None, metavar="ADDR",
                   help="this node's address, as the other nodes reach it")
    g.add_argument("--slots", default=None, help=argparse.SUPPRESS)
    g.add_argument("--stop_with_parent", action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--world_info", default=None, help=argparse.SUPPRESS)


def add_fault_tolerance_arguments(parser: argparse.ArgumentParser) -> None:
    """Replica groups on torchft (docs/fault-tolerance.md)."""
    g = parser.add_argument_group("fault tolerance (replica groups on torchft; needs shardwise[ft])")
    g.add_argument("--ft_replicas", "--ft-replicas", type=int, default=None, metavar="R",
                   help="run R replica groups of --num_procs processes each, with a lighthouse on this node; "
                   "a group whose process dies is restarted alone (up to --max_restarts) and rejoins. "
                   "With --ft_lighthouse: the number of replica groups of the whole job")
    g.add_argument("--ft_lighthouse", "--ft-lighthouse", default=None, metavar="HOST:PORT",
                   help="the lighthouse of a job spread over several launchers: run one replica group here")
    g.add_argument("--ft_replica_id", "--ft-replica-id", type=int, default=None, metavar="I",
                   help="with --ft_lighthouse: this launcher's replica group (0 .. R-1)")
    g.add_argument("--ft_min_replicas", "--ft-min-replicas", type=int, default=1, metavar="N",
                   help="the lighthouse --ft_replicas starts: replica groups a quorum needs (default 1)")
    g.add_argument("--ft_join_timeout", "--ft-join-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="the lighthouse: how long to wait for stragglers before a quorum without them (default 5)")
    g.add_argument("--ft_heartbeat_timeout", "--ft-heartbeat-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="the lighthouse: silence after which a replica group counts as lost (default 5)")


_FT_FIELDS = ("ft_replicas", "ft_lighthouse", "ft_replica_id", "ft_min_replicas", "ft_join_timeout",
              "ft_heartbeat_timeout")

_MULTINODE_FIELDS = ("hostfile", "include", "exclude", "num_nodes", "node_rank", "no_ssh",
                     "ssh_port", "launcher", "launcher_args", "force_multi", "bind_cores_to_rank",
                     "elastic", "comm_timeout", "skip_doctor", "local_addr", "slots",
                     "stop_with_parent", "world_info")


def options_from_args(ns: argparse.Namespace) -> LaunchOptions:
    from shardwise.launcher.ds_flags import apply_log_level, normalize_launcher

    fields = {k: getattr(ns, k) for k in _MULTINODE_FIELDS}
    fields.update({k: getattr(ns, k, LaunchOptions.__dataclass_fields__[k].default) for k in _FT_FIELDS})
    fields["launcher"] = normalize_launcher(fields["launcher"])
    each_rank_log = getattr(ns, "enable_each_rank_log", None)
    if each_rank_log == "None":  # DeepSpeed's default value, typed out by some scripts
        each_rank_log = None
    fields["skip_doctor"] = fields["skip_doctor"] or getattr(ns, "no_ssh_check", False)
    fields["bind_cores_to_rank"] = fields["bind_cores_to_rank"] or bool(getattr(ns, "bind_core_list", None))
    apply_log_level(ns)
    return LaunchOptions(script=ns.script, script_args=list(ns.script_args),
                         num_procs=ns.num_procs, master_addr=ns.master_addr,
                         master_port=ns.master_port, module=ns.module, no_python=ns.no_python,
                         no_local_rank=ns.no_local_rank, save_pid=ns.save_pid,
                         max_restarts=ns.max_restarts, enable_each_rank_log=each_rank_log,
                         bind_core_list=getattr(ns, "bind_core_list", None),
                         venv_script=getattr(ns, "venv_script", None), **fields)


def parse_elastic(spec: str) -> tuple[int, int]:
    """'MIN:MAX' (or 'N') nodes -> (min, max); ValueError naming --elastic."""
    lo, _, hi = spec.partition(":")
    try:
        nmin, nmax = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--elastic {spec!r}: expected MIN:MAX node counts, e.g. 1:4") from None
    if not 1 <= nmin <= nmax:
        raise ValueError(f"--elastic {spec!r}: need 1 <= MIN <= MAX")
    return nmin, nmax


# ----------------------------------------------------------------------------- checks

def validate(opts: LaunchOptions) -> None:
    """Raise ValueError naming the flag for anything that would fail after launch."""
    if opts.num_procs is not None and opts.num_procs < 1:
        raise ValueError(f"--num_gpus/--num_procs must be at least 1, got {opts.num_procs}")
    if opts.max_restarts < 0:
        raise ValueError(f"--max_restarts must be 0 or more, got {opts.max_restarts}")
    if opts.master_port is not None and not 1 <= opts.master_port <= 65535:
        raise ValueError(f"--master_port must be in 1..65535, got {opts.master_port}")
    if opts.master_addr is not None and not opts.master_addr:
        raise ValueError("--master_addr must not be empty")
    if opts.ssh_port is not None and not 1 <= opts.ssh_port <= 65535:
        raise ValueError(f"--ssh_port must be in 1..65535, got {opts.ssh_port}")
    if opts.num_nodes is not None and opts.num_nodes < 1:
        raise ValueError(f"--num_nodes must be at least 1, got {opts.num_nodes}")
    if opts.node_rank is not None and opts.node_rank < 0:
        raise ValueError(f"--node_rank must be 0 or more, got {opts.node_rank}")
    if opts.comm_timeout is not None and not opts.comm_timeout > 0:
        raise ValueError(f"--comm_timeout must be a positive number of seconds, got {opts.comm_timeout}")
    if opts.include and opts.exclude:
        raise ValueError("--include and --exclude cannot be combined")
    _validate_fault_tolerance(opts)
    if (opts.include or opts.exclude) and (opts.num_nodes is not None or opts.num_procs is not None):
        raise ValueError("--num_nodes/--num_gpus cannot be combined with --include/--exclude: "
                         "the filter already says which hosts and slots to use")
    if opts.launcher not in ("ssh", "pdsh", "slurm", "mpi"):
        raise ValueError(f"--launcher must be ssh, pdsh, slurm or mpi, got {opts.launcher!r}")
    if opts.elastic is not None:
        parse_elastic(opts.elastic)
    if opts.bind_core_list:
        from shardwise.launcher.ds_flags import parse_core_list

        parse_core_list(opts.bind_core_list)
    if opts.venv_script and not os.path.isfile(opts.venv_script):
        raise ValueError(f"--venv_script {opts.venv_script!r}: no such file")
    if opts.module and opts.no_python:
        raise ValueError("--module and --no_python cannot be combined: a module needs Python")
    if opts.module:
        top = opts.script.split(".")[0]
        if not top.isidentifier():
            raise ValueError(f"--module: {opts.script!r} is not a module name")
        # Workers run 'python -m' from this directory, so it is on their path too. The meta-path
        # finders (importlib.util.find_spec) see packages installed in editable mode.
        if importlib.machinery.PathFinder.find_spec(top, [os.getcwd(), *_sys_path()]) is None \
                and importlib.util.find_spec(top) is None and top not in _builtin_module_names():
            raise ValueError(f"--module: no module named {top!r} on the Python path "
                             f"(searched the current directory and sys.path)")
    elif opts.no_python:
        if shutil.which(opts.script) is None:
            raise ValueError(f"--no_python: program {opts.script!r} not found or not executable")
    elif not os.path.isfile(opts.script):
        where = os.path.abspath(opts.script)
        raise ValueError(f"script not found: {opts.script!r} (looked for {where})")


def _validate_fault_tolerance(opts: LaunchOptions) -> None:
    if opts.ft_replicas is None and opts.ft_lighthouse is None:
        if opts.ft_replica_id is not None:
            raise ValueError("--ft_replica_id needs --ft_lighthouse HOST:PORT and --ft_replicas R")
        return
    if opts.ft_replicas is None or opts.ft_replicas < 1:
        raise ValueError(f"--ft_replicas must be at least 1, got {opts.ft_replicas}" if opts.ft_replicas is not None
                         else "--ft_lighthouse needs --ft_replicas R (the number of replica groups of the job)")
    if opts.ft_lighthouse is not None:
        host, _, port = opts.ft_lighthouse.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"--ft_lighthouse {opts.ft_lighthouse!r}: expected HOST:PORT")
        if opts.ft_replica_id is None:
            raise ValueError("--ft_lighthouse needs --ft_replica_id I (this launcher's replica group)")
    if opts.ft_replica_id is not None and not 0 <= opts.ft_replica_id < opts.ft_replicas:
        raise ValueError(f"--ft_replica_id {opts.ft_replica_id} is not in 0..{opts.ft_replicas - 1} (--ft_replicas)")
    if opts.ft_replica_id is not None and opts.ft_lighthouse is None:
        raise ValueError("--ft_replica_id needs --ft_lighthouse HOST:PORT")
    if not 1 <= opts.ft_min_replicas <= opts.ft_replicas:
        raise ValueError(f"--ft_min_replicas {opts.ft_min_replicas} must be in 1..{opts.ft_replicas} (--ft_replicas)")
    if not (opts.ft_join_timeout >= 0 and opts.ft_heartbeat_timeout > 0):
        raise ValueError("--ft_join_timeout must be 0 or more and --ft_heartbeat_timeout more than 0 seconds")
    if opts.hostfile or opts.num_nodes or opts.elastic or opts.no_ssh or opts.world_info:
        raise ValueError("--ft_replicas runs replica groups on this node; across nodes run one launcher per "
                         "replica group with --ft_lighthouse HOST:PORT --ft_replica_id I (docs/fault-tolerance.md)")


def _sys_path() -> list[str]:
    import sys

    return [p for p in sys.path if p]


def _builtin_module_names() -> tuple[str, ...]:
    import sys

    return sys.builtin_module_names


# ------------------------------------------------------------------ resolved settings

def count_accelerators() -> tuple[int, str]:
    """(number of visible accelerators, their kind), or (0, "cpu") when there are none."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        device = acc.current_accelerator()
        return acc.device_count(), getattr(device, "type", "accelerator")
    if torch.cuda.is_available():
        return torch.cuda.device_count(), "cuda"
    return 0, "cpu"


def resolve_num_procs(requested: int | None, *, accelerators: int, kind: str) -> int:
    if requested is None:
        return max(1, accelerators)
    if accelerators and requested > accelerators:
        raise ValueError(f"--num_gpus {requested} asks for more processes than the "
                         f"{accelerators} visible {kind} device(s)")
    return requested


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_rank(nprocs: int, *, cores: int) -> int:
    """Intra-op threads per local rank so the ranks together do not oversubscribe the CPU."""
    return max(1, cores // nprocs)


def port_is_free(addr: str, port: int) -> bool:
    """False if something on this machine already listens on (addr, port).

    An address that is not local cannot be probed; it is reported free and the
    rendezvous will report any problem.
    """
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return True
    family, socktype, proto, _, sockaddr = infos[0]
    with socket.socket(family, socktype, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does
        try:
            s.bind(sockaddr)
        except OSError as exc:
            import errno

            return exc.errno != errno.EADDRINUSE
    return True


def free_port(addr: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            s.bind(("", 0))
        return s.getsockname()[1]


def resolve_master_port(opts: LaunchOptions, addr: str | None = None) -> tuple[int, str | None]:
    """(port to use, a note to print if it is not the one the user would expect).

    Only for the node that hosts the rendezvous: other nodes cannot see the port's state.
    """
    addr = addr or opts.master_addr or DEFAULT_MASTER_ADDR
    if opts.master_port is not None:
        if not port_is_free(addr, opts.master_port):
            raise ValueError(f"--master_port {opts.master_port} is already in use on "
                             f"{addr}; pick another port or leave it unset")
        return opts.master_port, None
    if port_is_free(addr, DEFAULT_MASTER_PORT):
        return DEFAULT_MASTER_PORT, None
    port = free_port(addr)
    return port, f"default port {DEFAULT_MASTER_PORT} is busy, using free port {port}"
