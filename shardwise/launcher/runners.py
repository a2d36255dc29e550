"""Commands that start one node agent per host: over ssh, pdsh, Slurm's srun or mpirun.

Every node runs the same agent: ``python -m shardwise run --no_ssh ...`` with the whole
job's hosts and slots (``--world_info``), which starts that node's ranks through torch's
elastic agent. The runners differ only in how the agents are started and how each
learns its node rank: from ``--local_addr`` (ssh, pdsh: the host's position in the
world info) or from the launcher's variables (``SLURM_NODEID``, ``OMPI_COMM_WORLD_RANK``).
"""
from __future__ import annotations

import base64
import json
import os
import shlex
import shutil
import sys

from .options import LaunchOptions

Resources = dict[str, list[int]]
SSH_ARGS_ENV = "SHARDWISE_SSH_ARGS"  # extra ssh arguments, e.g. "-F ~/.ssh/cluster_config"
_PROGRAMS = {"ssh": "ssh", "pdsh": "pdsh", "slurm": "srun", "mpi": "mpirun"}


def encode_world_info(hosts: Resources) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(hosts.items())).encode()).decode()


def decode_world_info(text: str) -> Resources:
    try:
        return {h: list(s) for h, s in json.loads(base64.urlsafe_b64decode(text.encode()))}
    except (ValueError, TypeError) as exc:
        raise ValueError(f"--world_info: not a value written by the launcher ({exc})") from None


def require_program(launcher: str) -> str:
    program = _PROGRAMS[launcher]
    path = shutil.which(program)
    if path is None:
        raise ValueError(f"--launcher {launcher} needs '{program}' on PATH, and it is not "
                         f"installed here" + ("" if launcher == "ssh" else "; try --launcher ssh"))
    return path


def ssh_command(opts: LaunchOptions, *, connect_timeout: int = 10) -> list[str]:
    """``ssh`` with the options every remote call uses (no password prompts, our port)."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout}"]
    if opts.ssh_port is not None:
        cmd += ["-p", str(opts.ssh_port)]
    return cmd + shlex.split(os.environ.get(SSH_ARGS_ENV, ""))


def agent_command(opts: LaunchOptions, hosts: Resources, *, master_addr: str, master_port: int,
                  local_addr: str | None) -> list[str]:
    """The node agent's command line (the same on every node, apart from ``local_addr``)."""
    cmd = [sys.executable, "-u", "-m", "shardwise", "run", "--no_ssh", "--stop_with_parent",
           "--world_info", encode_world_info(hosts), "--master_addr", master_addr,
           "--master_port", str(master_port), "--max_restarts", str(opts.max_restarts)]
    if local_addr is not None:
        cmd += ["--local_addr", local_addr]
    if opts.force_multi:
        cmd.append("--force_multi")
    for flag in ("module", "no_python", "no_local_rank", "save_pid", "bind_cores_to_rank"):
        if getattr(opts, flag):
            cmd.append(f"--{flag}")
    if opts.elastic is not None:
        cmd += ["--elastic", opts.elastic]
    if opts.comm_timeout is not None:
        cmd += ["--comm_timeout", str(opts.comm_timeout)]
    for flag in ("enable_each_rank_log", "bind_core_list", "venv_script"):  # DeepSpeed's (ds_flags.py)
        if getattr(opts, flag):
            cmd += [f"--{flag}", str(getattr(opts, flag))]
    return cmd + [opts.script, *opts.script_args]


def remote_shell(command: list[str], env: dict[str, str], cwd: str) -> str:
    """One shell line: go to ``cwd``, set ``env``, become ``command`` (exec, so the ssh
    session is the agent's parent and its end stops the agent)."""
    assigns = [f"{k}={v}" for k, v in env.items()]
    return f"cd {shlex.quote(cwd)} && exec env {shlex.join(assigns + command)}"


def ssh_commands(opts: LaunchOptions, hosts: Resources, *, master_addr: str, master_port: int,
                 env: dict[str, str], cwd: str) -> list[tuple[str, list[str]]]:
    """(host, ssh command) for every host."""
    out = []
    for host in hosts:
        agent = agent_command(opts, hosts, master_addr=master_addr, master_port=master_port,
                              local_addr=host)
        out.append((host, [*ssh_command(opts), host, remote_shell(agent, env, cwd)]))
    return out


def pdsh_command(opts: LaunchOptions, hosts: Resources, *, master_addr: str, master_port: int,
                 env: dict[str, str], cwd: str) -> tuple[list[str], dict[str, str]]:
    """(pdsh command, variables pdsh itself needs). pdsh puts each host's name for %h."""
    token = "SHARDWISE_PDSH_HOST"
    agent = agent_command(opts, hosts, master_addr=master_addr, master_port=master_port,
                          local_addr=token)
    # pdsh expands %-sequences in the command: keep the user's '%' literal, ours becomes %h
    line = remote_shell(agent, env, cwd).replace("%", "%%").replace(token, "%h")
    ssh_args = ["-o", "BatchMode=yes"] + (["-p", str(opts.ssh_port)] if opts.ssh_port else [])
    extra = os.environ.get(SSH_ARGS_ENV, "")
    pdsh_env = {"PDSH_RCMD_TYPE": "ssh",
                "PDSH_SSH_ARGS_APPEND": " ".join([*ssh_args, extra]).strip()}
    cmd = ["pdsh", "-S", "-N", "-f", "1024", "-w", ",".join(hosts),
           *shlex.split(opts.launcher_args), line]
    return cmd, pdsh_env


def slurm_command(opts: LaunchOptions, hosts: Resources, *, master_addr: str, master_port: int,
                  env: dict[str, str], cwd: str) -> list[str]:
    """srun starts one agent per node; each reads its node rank from SLURM_NODEID."""
    agent = agent_command(opts, hosts, master_addr=master_addr, master_port=master_port,
                          local_addr=None)
    n = len(hosts)
    return ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1",
            f"--nodelist={','.join(hosts)}", "--kill-on-bad-exit=1", f"--chdir={cwd}",
            *shlex.split(opts.launcher_args), "env", *[f"{k}={v}" for k, v in env.items()],
            *agent]


def mpi_command(opts: LaunchOptions, hosts: Resources, *, master_addr: str, master_port: int,
                env: dict[str, str], cwd: str) -> list[str]:
    """OpenMPI's mpirun starts one agent per host; each reads OMPI_COMM_WORLD_RANK."""
    agent = agent_command(opts, hosts, master_addr=master_addr, master_port=master_port,
                          local_addr=None)
    cmd = ["mpirun", "-n", str(len(hosts)), "--host", ",".join(f"{h}:1" for h in hosts),
           "--map-by", "ppr:1:node", "--wdir", cwd]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    for k, v in env.items():
        cmd += ["-x", f"{k}={v}"]
    return cmd + shlex.split(opts.launcher_args) + agent
