"""Fault tolerance on torchft (shardwise/ft, docs/fault-tolerance.md): real launches of replica groups.

Each test starts whole jobs with ``shardwise run --ft_replicas`` (the lighthouse, one launcher per
replica group, gloo inside and across the groups) running tests/scripts/ft_train.py, which records
every rank's step counters, losses, recovery and final weights in JSON files. Independent jobs of a test
run at the same time.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.config import ConfigError, load_config
from shardwise.launcher.options import LaunchOptions, validate

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "ft_train.py"
LIGHTHOUSE_FLAGS = ["--ft_join_timeout", "1", "--ft_heartbeat_timeout", "1"]
JOB_TIMEOUT = 600  # seconds; a job on an idle machine takes well under a minute
slow_launches = pytest.mark.timeout(1800)  # several jobs in turn, on a shared 2-core machine


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", RUST_LOG="warn")
    env.pop("REPLICA_GROUP_ID", None)
    return env


def _start(out: Path, steps: int, *script_args: str, replicas: int = 2, procs: int = 1, restarts: int = 1,
           launcher: list[str] | None = None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    flags = launcher if launcher is not None else ["--ft_replicas", str(replicas), *LIGHTHOUSE_FLAGS]
    cmd = [sys.executable, "-m", "shardwise", "run", "--num_procs", str(procs), "--max_restarts", str(restarts),
           *flags, str(SCRIPT), str(out), str(steps), *script_args]
    return subprocess.Popen(cmd, cwd=out, env=_env(), stdout=open(out / "launch.log", "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(job: subprocess.Popen, out: Path) -> int:
    try:
        return job.wait(timeout=JOB_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        pytest.fail(f"job in {out} hung; its output:\n{(out / 'launch.log').read_text()[-4000:]}")


def _ok(job: subprocess.Popen, out: Path) -> None:
    rc = _finish(job, out)
    assert rc == 0, f"job in {out} exited {rc}:\n{(out / 'launch.log').read_text()[-6000:]}"


def _records(out: Path) -> dict[tuple[int, int, int], dict]:
    """(replica, rank, attempt) -> what ft_train.py recorded."""
    recs = {}
    for f in out.glob("r*_a*.json"):
        r, rank, a = f.stem[1:].replace("_a", "_").split("_")
        recs[int(r), int(rank), int(a)] = json.loads(f.read_text())
    return recs


def _check_survived_kill(out: Path, *, procs: int, kill_at: int) -> dict:
    """The invariants of a job in which replica group 1 was killed at step ``kill_at``."""
    recs = _records(out)
    for rank in range(procs):
        survivor = recs[0, rank, 0]
        assert (0, rank, 1) not in recs, "the surviving replica group was restarted"
        steps = survivor["steps"]
        assert steps == sorted(steps) and steps[0] == 0, f"the survivor's step counter went back: {steps}"
        assert survivor["discarded"] >= 1, "the step in flight when the group died was not discarded"
        assert steps.count(kill_at) == 2, f"step {kill_at} (in flight at the kill) was not retried once: {steps}"
        killed, back = recs[1, rank, 0], recs[1, rank, 1]
        assert "params" not in killed and killed["steps"][-1] <= kill_at + 1
        assert back["recovered"] and back["start_step"] > kill_at, back  # resumed past it, from a live peer
        assert back["recovered_at_step"] == back["start_step"] == back["loaded_step"]
        assert back["steps"][0] == back["start_step"], "the rejoined group did not continue from the peer's step"
        assert len(back["steps"]) >= 3, "the groups did not train on together after the rejoin"
        assert back["final_step"] == survivor["final_step"]
        assert back["params"] == survivor["params"], "the replica groups' weights differ (bitwise)"
    return recs


def _losses(rec: dict) -> list[float]:
    return [rec["losses"][k] for k in sorted(rec["losses"], key=int)]


# -------------------------------------------------------------------------------- config and flags
def test_config_block_and_launcher_flags(monkeypatch):
    cfg = load_config({"train_batch_size": 2, "fault_tolerance": {"enabled": True, "min_replicas": 2}})
    assert cfg.fault_tolerance.enabled and cfg.fault_tolerance.min_replicas == 2
    with pytest.raises(ConfigError, match=r"fault_tolerance.*algorithm 'diloco' is not implemented"):
        load_config({"train_batch_size": 2, "fault_tolerance": {"enabled": True, "algorithm": "diloco"}})
    with pytest.raises(ConfigError, match=r"fault_tolerance.*min_replicas"):
        load_config({"train_batch_size": 2, "fault_tolerance": {"enabled": True, "min_replicas": 0}})
    monkeypatch.setitem(sys.modules, "torchft", None)  # as if torchft were not installed
    with pytest.raises(ConfigError, match=r"fault_tolerance.*torchft is not installed: pip install shardwise\[ft\]"):
        load_config({"train_batch_size": 2, "fault_tolerance": {"enabled": True}})
    load_config({"train_batch_size": 2, "fault_tolerance": {"enabled": False}})  # off: torchft not needed

    def bad(match, **kw):
        with pytest.raises(ValueError, match=match):
            validate(LaunchOptions(script=str(SCRIPT), **kw))

    bad("--ft_lighthouse needs --ft_replica_id", ft_replicas=2, ft_lighthouse="host:29510")
    bad("--ft_lighthouse needs --ft_replicas", ft_lighthouse="host:29510", ft_replica_id=0)
    bad(r"--ft_replica_id 2 is not in 0..1", ft_replicas=2, ft_lighthouse="host:29510", ft_replica_id=2)
    bad("expected HOST:PORT", ft_replicas=2, ft_lighthouse="host", ft_replica_id=0)
    bad("--ft_replicas must be at least 1", ft_replicas=0)
    bad("--ft_min_replicas 3 must be in 1..2", ft_replicas=2, ft_min_replicas=3)
    bad("one launcher per replica group", ft_replicas=2, num_nodes=2)
    validate(LaunchOptions(script=str(SCRIPT), ft_replicas=2, ft_lighthouse="host:29510", ft_replica_id=1))


# -------------------------------------------------------------------------------- a lost replica group
@slow_launches
def test_kill_one_replica_group_2x1_and_checkpoints(tmp_path):
    """2 replica groups x 1 process: kill -9 of group 1 at step 4 against the fault-free job; then a
    replica-group checkpoint loads without fault tolerance, and that one's checkpoint back with it."""
    free_out, kill_out = tmp_path / "fault_free", tmp_path / "killed"
    ckpt_ft, ckpt_plain = tmp_path / "ckpt_ft", tmp_path / "ckpt_plain"
    free = _start(free_out, 10, "--save", str(ckpt_ft), restarts=0)
    killed = _start(kill_out, 10, "--kill_at", "4")
    _ok(free, free_out)
    _ok(killed, kill_out)

    ref = _records(free_out)
    assert ref[0, 0, 0]["params"] == ref[1, 0, 0]["params"] and ref[0, 0, 0]["final_step"] == 10
    recs = _check_survived_kill(kill_out, procs=1, kill_at=4)
    survivor, ref_losses = _losses(recs[0, 0, 0]), _losses(ref[0, 0, 0])
    assert survivor[:4] == ref_losses[:4], "before the fault the job must train exactly as the fault-free one"
    # after it: the loss goes on down as in the fault-free job (the survivor trains longer, on its share)
    assert sum(survivor[-3:]) / 3 < 0.5 * sum(ref_losses[:3]) / 3
    assert min(survivor) < 2 * min(ref_losses)

    # the fault-tolerant job's checkpoint without fault tolerance, and back
    plain_out = tmp_path / "plain"
    _ok(_start(plain_out, 14, "--no_ft", "--load", str(ckpt_ft), "--save", str(ckpt_plain), restarts=0,
               launcher=[]), plain_out)
    plain = _records(plain_out)[0, 0, 0]
    assert plain["loaded_step"] == 10 and plain["final_step"] == 14
    back_out = tmp_path / "back"
    _ok(_start(back_out, 16, "--load", str(ckpt_plain), restarts=0), back_out)
    back = _records(back_out)
    for r in range(2):
        assert back[r, 0, 0]["loaded_step"] == 14 and back[r, 0, 0]["final_step"] == 16
    assert back[0, 0, 0]["params"] == back[1, 0, 0]["params"]


@slow_launches
def test_kill_one_replica_group_2x2_zero1_and_zero3(tmp_path):
    """2 replica groups x 2 processes, ZeRO-1 and ZeRO-3 inside each group (two jobs at once)."""
    outs = {stage: tmp_path / f"zero{stage}" for stage in (1, 3)}
    jobs = {stage: _start(out, 8, "--kill_at", "3", "--stage", str(stage), procs=2) for stage, out in outs.items()}
    for stage, job in jobs.items():
        _ok(job, outs[stage])
    for stage, out in outs.items():
        recs = _check_survived_kill(out, procs=2, kill_at=3)
        assert recs[0, 0, 0]["params"] == recs[0, 1, 0]["params"]  # (ZeRO: the gathered weights agree in a group)


# -------------------------------------------------------------------------------- joining late; no lighthouse
@slow_launches
def test_late_joiner_and_lighthouse_gone(tmp_path):
    """A replica group that starts 15 s after the other takes its live state; a lighthouse that dies
    mid-training stops the job with a named error, not a hang."""
    late_out, gone_out = tmp_path / "late", tmp_path / "gone"
    late = _start(late_out, 6, "--late", "15", "--quorum_timeout", "5", restarts=0)
    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    lighthouse = subprocess.Popen([str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "1",
                                   "--bind", f"[::]:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        gone = _start(gone_out, 100000, "--step_sleep", "0.05", "--quorum_timeout", "10", restarts=0, replicas=1,
                      launcher=["--ft_replicas", "1", "--ft_lighthouse", f"127.0.0.1:{port}", "--ft_replica_id", "0"])
        deadline = time.monotonic() + JOB_TIMEOUT
        rec = gone_out / "r0_0_a0.json"
        while time.monotonic() < deadline and gone.poll() is None:
            if rec.exists() and len(json.loads(rec.read_text() or "{}").get("steps", [])) > 3:
                break
            time.sleep(0.5)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    killed_at = time.monotonic()
    rc = _finish(gone, gone_out)
    log = (gone_out / "launch.log").read_text()
    assert rc != 0 and "FaultToleranceError" in log and "could not form a quorum with the lighthouse" in log, log[-4000:]
    assert time.monotonic() - killed_at < 120, "the job did not stop soon after the lighthouse died"

    _ok(late, late_out)
    recs = _records(late_out)
    first, joiner = recs[0, 0, 0], recs[1, 0, 0]
    assert first["steps"][0] == 0 and not first["recovered"]
    assert joiner["recovered"] and joiner["start_step"] > 0 and joiner["steps"][0] == joiner["start_step"]
    assert len(joiner["steps"]) >= 3
    assert joiner["final_step"] == first["final_step"] and joiner["params"] == first["params"]


# -------------------------------------------------------------------------------- the live state, in one process
def _state_body(rank, world_size):
    """A peer's live state (shardwise/ft/state.py) makes a fresh engine train on exactly as the peer:
    weights, ZeRO storage, optimizer moments, scheduler, counters and data position, at ZeRO 0, 1 and 3."""
    import torch

    import shardwise
    from shardwise.ft import state as live_state
    from shardwise.utils import RepeatingLoader, safe_get_full_fp32_param

    out = {}
    for stage in (0, 1, 3):
        def build(seed):
            torch.manual_seed(seed)
            model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            x = torch.randn(64, 6, generator=torch.Generator().manual_seed(5))
            data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
            config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage},
                      "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 0.01}}}
            engine, _, loader, _ = shardwise.initialize(model=model, config=config, training_data=data)
            return engine, iter(RepeatingLoader(loader))

        def train(engine, it, n):
            for _ in range(n):
                xb, yb = next(it)
                engine.backward(torch.nn.functional.mse_loss(engine(xb), yb))
                engine.step()

        def weights(engine):
            return [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]

        peer, peer_it = build(0)
        train(peer, peer_it, 3)
        fresh, _ = build(1)
        assert any(not torch.equal(a, b) for a, b in zip(weights(peer), weights(fresh)))
        live_state.restore(fresh, live_state.capture(peer))
        fresh_it = iter(RepeatingLoader(fresh.training_dataloader))  # a new iterator: from the peer's data position
        assert fresh.global_steps == peer.global_steps == 3 and fresh.get_lr() == peer.get_lr()
        train(peer, peer_it, 2)
        train(fresh, fresh_it, 2)
        out[stage] = (fresh.global_steps, all(torch.equal(a, b) for a, b in zip(weights(peer), weights(fresh))))
    return out


def test_live_state_carries_everything_a_step_needs():
    from distributed import run_distributed

    (result,) = run_distributed(_state_body, 1, timeout=240)
    assert result == {0: (5, True), 1: (5, True), 3: (5, True)}, result
