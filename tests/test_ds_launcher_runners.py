"""DeepSpeed's launcher runners through the compat package: ``deepspeed.launcher.runner.parse_args`` gives
DeepSpeed's namespace, and ``multinode_runner.PDSHRunner`` / ``OpenMPIRunner`` / ``MPICHRunner`` /
``MVAPICHRunner`` / ``SlurmRunner`` build the command that starts shardwise's node agent on every host
with the job's hosts, the user's script and its arguments, and the runner's exports."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_PROBE = r"""
import base64, json, os, shlex
from deepspeed.launcher import multinode_runner as mn
from deepspeed.launcher.runner import encode_world_info, parse_args

hosts = {"worker-0": 4, "worker-1": 4}
world = encode_world_info({h: list(range(n)) for h, n in hosts.items()})
args = parse_args(["--master_addr", "10.0.0.1", "--master_port", "6000", "train.py", "--lr", "0.1"])
assert (args.user_script, args.user_args, args.launcher, args.num_gpus) == ("train.py", ["--lr", "0.1"], "pdsh", -1)
assert args.hostfile == "/job/hostfile" and args.enable_each_rank_log == "None"

def agent(cmd):  # the node agent's part of a command: shardwise run --no_ssh ... train.py --lr 0.1
    i = cmd.index("shardwise")
    tail = cmd[i:]
    assert tail[:3] == ["shardwise", "run", "--no_ssh"], tail
    assert tail[-3:] == ["train.py", "--lr", "0.1"], tail
    wi = tail[tail.index("--world_info") + 1]
    assert json.loads(base64.urlsafe_b64decode(wi)) == [["worker-0", [0, 1, 2, 3]], ["worker-1", [0, 1, 2, 3]]]
    assert tail[tail.index("--master_addr") + 1] == "10.0.0.1" and tail[tail.index("--master_port") + 1] == "6000"
    return tail

env = {}
r = mn.PDSHRunner(args, world)
r.add_export("NCCL_DEBUG", "INFO")
cmd, kill, env = r.get_cmd(env, hosts)
assert cmd[0] == "pdsh" and env["PDSH_RCMD_TYPE"] == "ssh" and "worker-0,worker-1" in cmd
line = shlex.split(cmd[-1])
assert "NCCL_DEBUG=INFO" in line and line.index("NCCL_DEBUG=INFO") < line.index("shardwise"), line
agent(line)
assert kill[0] == "pdsh" and "--world_info" in kill[-1]

r = mn.OpenMPIRunner(args, world, hosts)
cmd = r.get_cmd({}, hosts)
assert cmd[0] == "mpirun" and cmd[cmd.index("btl_tcp_if_include") + 1] == "eth0"
agent(cmd)
for given in ("-mca btl_tcp_if_include eth1", "--mca btl_tcp_if_include eth1"):
    a2 = parse_args(["--launcher_args", given, "train.py", "--lr", "0.1"])
    cmd = mn.OpenMPIRunner(a2, world, hosts).get_cmd({}, hosts)
    assert "eth1" in cmd and "eth0" not in cmd, cmd

for cls in (mn.MPICHRunner, mn.IMPIRunner, mn.MVAPICHRunner):
    r = cls(args, world, hosts)
    cmd = r.get_cmd({}, hosts)
    assert cmd[:5] == ["mpirun", "-n", "2", "-ppn", "1"] and cmd[cmd.index("-hosts") + 1] == "worker-0,worker-1"
    agent(cmd)
assert "MV2_SMP_USE_CMA" in mn.MVAPICHRunner(args, world, hosts).get_cmd({}, hosts)

cmd = mn.SlurmRunner(args, world, hosts).get_cmd({}, hosts)
assert cmd[0] == "srun" and "--nodes=2" in cmd
agent(cmd)
print("ok")
"""


def test_deepspeed_runners_build_shardwise_agent_commands(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "compat" / "deepspeed"), str(REPO)])}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=180,
                         cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
