"""``deepspeed.launcher.multinode_runner``: DeepSpeed's base class for a multi-node launcher backend, which
code written for DeepSpeed subclasses for its own cluster tool: ``exports`` (environment variables for the
remote shell line, quoted when needed), ``user_arguments``, ``name``.

DeepSpeed's concrete runners (``PDSHRunner``, ``OpenMPIRunner``, ``MPICHRunner``, ``IMPIRunner``,
``MVAPICHRunner``, ``SlurmRunner``) take DeepSpeed's arguments (``deepspeed.launcher.runner.parse_args``)
and build the command with shardwise's launcher (``shardwise.launcher.runners``): every node runs
shardwise's node agent (``python -m shardwise run --no_ssh ...``), which starts that node's ranks; the
runner's ``exports`` reach the ranks as environment variables. ``JSRunner`` (IBM's jsrun) is not provided.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shlex
import shutil
from abc import ABC, abstractmethod

__all__ = ["MultiNodeRunner", "PDSHRunner", "OpenMPIRunner", "MPICHRunner", "IMPIRunner", "MVAPICHRunner",
           "SlurmRunner"]

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


def _resources(pool) -> dict[str, list[int]]:
    """DeepSpeed's resource pool (``{host: slots}`` or ``{host: [slot, ...]}``) as ``{host: [slot, ...]}``."""
    return {h: (list(range(v)) if isinstance(v, int) else list(v)) for h, v in pool.items()}


class _ShardwiseRunner(MultiNodeRunner):
    """A DeepSpeed runner whose command starts shardwise's node agent on every host."""

    program = ""

    def __init__(self, args, world_info_base64: str, resource_pool=None) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def backend_exists(self):
        return shutil.which(self.program) is not None

    def _hosts(self, active_resources) -> dict[str, list[int]]:
        if active_resources:
            return _resources(active_resources)
        return _resources(json.loads(base64.urlsafe_b64decode(self.world_info_base64)))

    def _options(self, launcher_args: str | None = None):
        from shardwise.launcher.options import LaunchOptions

        a = self.args
        log_dir = getattr(a, "enable_each_rank_log", None)
        return LaunchOptions(
            script=self.user_script, script_args=list(self.user_arguments or []),
            module=bool(getattr(a, "module", False)), no_python=bool(getattr(a, "no_python", False)),
            no_local_rank=bool(getattr(a, "no_local_rank", False)), save_pid=bool(getattr(a, "save_pid", False)),
            ssh_port=getattr(a, "ssh_port", None), force_multi=bool(getattr(a, "force_multi", False)),
            launcher_args=getattr(a, "launcher_args", "") if launcher_args is None else launcher_args,
            bind_cores_to_rank=bool(getattr(a, "bind_cores_to_rank", False)),
            enable_each_rank_log=None if log_dir in (None, "None") else log_dir,
            bind_core_list=getattr(a, "bind_core_list", None), venv_script=getattr(a, "venv_script", None))

    def _where(self, hosts):
        a = self.args
        port = getattr(a, "master_port", None) or 29500
        return {"master_addr": getattr(a, "master_addr", "") or next(iter(hosts)), "master_port": int(port),
                "env": {k: v for k, v in self.exports.items()}, "cwd": os.path.abspath(".")}


class PDSHRunner(_ShardwiseRunner):
    """pdsh starts the agents; ``get_cmd`` returns ``(command, kill command, environment)`` as DeepSpeed's."""

    program = "pdsh"

    def __init__(self, args, world_info_base64: str) -> None:
        super().__init__(args, world_info_base64)

    @property
    def name(self) -> str:
        return "pdsh"

    def get_cmd(self, environment, active_resources):
        from shardwise.launcher import runners

        hosts = self._hosts(active_resources)
        cmd, pdsh_env = runners.pdsh_command(self._options(), hosts, **self._where(hosts))
        environment.update(pdsh_env)
        marker = runners.encode_world_info(hosts)  # this job's agents carry it in their command line
        kill_cmd = ["pdsh", "-S", "-f", "1024", "-w", ",".join(hosts), f"pkill -f -- '--world_info {marker}'"]
        return cmd, kill_cmd, environment


class OpenMPIRunner(_ShardwiseRunner):
    """OpenMPI's mpirun, one agent per host. As DeepSpeed's, ``--mca btl_tcp_if_include eth0`` is added
    unless ``--launcher_args`` chooses the interface."""

    program = "ompi_info"

    @property
    def name(self) -> str:
        return "openmpi"

    def get_cmd(self, environment, active_resources):
        from shardwise.launcher import runners

        launcher_args = getattr(self.args, "launcher_args", "") or ""
        words = shlex.split(launcher_args)
        chosen = any(w in ("-mca", "--mca") and nxt == "btl_tcp_if_include" for w, nxt in zip(words, words[1:]))
        if not chosen:
            launcher_args = " ".join(["--mca btl_tcp_if_include eth0", launcher_args]).strip()
        hosts = self._hosts(active_resources)
        return runners.mpi_command(self._options(launcher_args), hosts, **self._where(hosts))


class MPICHRunner(_ShardwiseRunner):
    """MPICH's (Hydra) mpirun, one agent per host; each agent's node rank is its ``PMI_RANK``."""

    program = "mpirun"

    @property
    def name(self) -> str:
        return "mpich"

    def get_cmd(self, environment, active_resources):
        from shardwise.launcher import runners

        hosts = self._hosts(active_resources)
        where = self._where(hosts)
        opts = self._options()
        agent = runners.agent_command(opts, hosts, master_addr=where["master_addr"],
                                      master_port=where["master_port"], local_addr=None)
        cmd = ["mpirun", "-n", str(len(hosts)), "-ppn", "1", "-hosts", ",".join(hosts), "-wdir", where["cwd"]]
        for k, v in where["env"].items():
            cmd += ["-genv", k, v]
        return cmd + shlex.split(opts.launcher_args) + agent


class IMPIRunner(MPICHRunner):
    """Intel MPI's mpirun (Hydra, as MPICH's)."""

    @property
    def name(self) -> str:
        return "impi"


class MVAPICHRunner(MPICHRunner):
    """MVAPICH2's mpirun (Hydra, as MPICH's); ``MV2_SMP_USE_CMA=0`` as DeepSpeed sets it."""

    def __init__(self, args, world_info_base64: str, resource_pool=None) -> None:
        super().__init__(args, world_info_base64, resource_pool)
        self.add_export("MV2_SMP_USE_CMA", "0")

    @property
    def name(self) -> str:
        return "mvapich"


class SlurmRunner(_ShardwiseRunner):
    """Slurm's srun, one agent per node; each agent's node rank is its ``SLURM_NODEID``."""

    program = "srun"

    @property
    def name(self) -> str:
        return "slurm"

    def get_cmd(self, environment, active_resources):
        from shardwise.launcher import runners

        hosts = self._hosts(active_resources)
        return runners.slurm_command(self._options(), hosts, **self._where(hosts))
