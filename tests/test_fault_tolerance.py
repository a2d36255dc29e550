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
LIGHTHOUSE_FLAGS = ["--ft_join_timeout", "2", "--ft_heartbeat_timeout", "1"]  # (join < a job's quorum_timeout < --late)
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
def _lighthouse(port: int) -> subprocess.Popen:
    return subprocess.Popen([str(Path(sys.executable).with_name("torchft_lighthouse")), "--min_replicas", "1",
                             "--bind", f"[::]:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@slow_launches
def test_kill_late_join_lighthouse_gone_and_checkpoints_2x1(tmp_path):
    """2 replica groups x 1 process. Round 1, four jobs at once: the fault-free job (saves a checkpoint);
    the same job with group 1 kill -9'd at step 3; a job without fault tolerance (saves a checkpoint);
    a 1-group job whose lighthouse dies mid-training (a named error, no hang). Round 2, two jobs at once:
    the fault-tolerant checkpoint loaded without fault tolerance; the plain checkpoint loaded by a
    fault-tolerant job whose group 1 starts 6 s late (and takes group 0's live state, not the checkpoint)."""
    out = {name: tmp_path / name for name in ("free", "killed", "plain", "gone", "plain_load", "late_load")}
    ckpt_ft, ckpt_plain = tmp_path / "ckpt_ft", tmp_path / "ckpt_plain"
    free = _start(out["free"], 8, "--save", str(ckpt_ft), restarts=0)
    killed = _start(out["killed"], 8, "--kill_at", "3")
    # (the two jobs started with one launcher each get ports of their own: both would take the default one)
    plain = _start(out["plain"], 4, "--no_ft", "--save", str(ckpt_plain), restarts=0,
                   launcher=["--master_port", str(_free_port())])
    port = _free_port()
    lighthouse = _lighthouse(port)
    try:
        gone = _start(out["gone"], 100000, "--step_sleep", "0.05", "--quorum_timeout", "3", restarts=0, replicas=1,
                      launcher=["--ft_replicas", "1", "--ft_lighthouse", f"127.0.0.1:{port}", "--ft_replica_id", "0",
                                "--master_port", str(_free_port())])
        deadline = time.monotonic() + JOB_TIMEOUT
        rec = out["gone"] / "r0_0_a0.json"
        while time.monotonic() < deadline and gone.poll() is None:
            if rec.exists() and len(json.loads(rec.read_text() or "{}").get("steps", [])) > 3:
                break
            time.sleep(0.2)
    finally:
        lighthouse.kill()
        lighthouse.wait()
    killed_at = time.monotonic()
    rc = _finish(gone, out["gone"])
    log = (out["gone"] / "launch.log").read_text()
    assert rc != 0 and "FaultToleranceError" in log and "could not form a quorum with the lighthouse" in log, log[-4000:]
    assert time.monotonic() - killed_at < 120, "the job did not stop soon after the lighthouse died"
    for name in ("free", "plain"):
        _ok({"free": free, "plain": plain}[name], out[name])
    # round 2 starts as soon as the checkpoints are there
    plain_load = _start(out["plain_load"], 12, "--no_ft", "--load", str(ckpt_ft), restarts=0,
                        launcher=["--master_port", str(_free_port())])
    late_load = _start(out["late_load"], 8, "--load", str(ckpt_plain), "--late", "6", "--quorum_timeout", "4",
                       restarts=0)
    _ok(killed, out["killed"])

    ref = _records(out["free"])
    assert ref[0, 0, 0]["params"] == ref[1, 0, 0]["params"] and ref[0, 0, 0]["final_step"] == 8
    recs = _check_survived_kill(out["killed"], procs=1, kill_at=3)
    survivor, ref_losses = _losses(recs[0, 0, 0]), _losses(ref[0, 0, 0])
    assert survivor[:3] == ref_losses[:3], "before the fault the job must train exactly as the fault-free one"
    # after it: the loss goes on down as in the fault-free job (the survivor trains longer, on its share)
    assert sum(survivor[-3:]) / 3 < 0.5 * sum(ref_losses[:3]) / 3
    assert min(survivor) < 2 * min(ref_losses)

    # the fault-tolerant job's checkpoint without fault tolerance, and a plain one with it
    _ok(plain_load, out["plain_load"])
    loaded = _records(out["plain_load"])[0, 0, 0]
    assert loaded["loaded_step"] == 8 and loaded["final_step"] == 12
    _ok(late_load, out["late_load"])
    recs = _records(out["late_load"])
    first, joiner = recs[0, 0, 0], recs[1, 0, 0]
    assert first["loaded_step"] == 4 and first["steps"][0] == 4 and not first["recovered"]
    assert joiner["recovered"] and joiner["start_step"] > 4 and joiner["steps"][0] == joiner["start_step"]
    assert joiner["loaded_step"] == joiner["start_step"], "the late group read the checkpoint besides the live state"
    assert len(joiner["steps"]) >= 3
    assert joiner["final_step"] == first["final_step"] and joiner["params"] == first["params"]


@slow_launches
def test_kill_one_replica_group_2x2_zero1_and_zero3(tmp_path):
    """2 replica groups x 2 processes, ZeRO-1 and ZeRO-3 inside each group (two jobs at once)."""
    outs = {stage: tmp_path / f"zero{stage}" for stage in (1, 3)}
    jobs = {stage: _start(out, 5, "--kill_at", "2", "--stage", str(stage), procs=2) for stage, out in outs.items()}
    for stage, job in jobs.items():
        _ok(job, outs[stage])
    for stage, out in outs.items():
        recs = _check_survived_kill(out, procs=2, kill_at=2)
        assert recs[0, 0, 0]["params"] == recs[0, 1, 0]["params"]  # (ZeRO: the gathered weights agree in a group)


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


# -------------------------------------------------------------------------------- LocalSGD and DiLoCo
def test_periodic_sync_config_refusals():
    def refused(match, **ft):
        with pytest.raises(ConfigError, match=match):
            load_config({"train_batch_size": 2, "fault_tolerance": {"enabled": True, **ft}})

    refused(r"fault_tolerance: sync_every is for algorithm \"local_sgd\" or \"diloco\"", sync_every=4)
    refused(r"fault_tolerance: outer_optimizer is for algorithm \"diloco\" \(algorithm is 'local_sgd'\)",
            algorithm="local_sgd", outer_optimizer={"type": "SGD"})
    refused(r"fault_tolerance: fragment_sync_delay, fragments are for algorithm \"diloco\"",
            fragments=2, fragment_sync_delay=1)
    refused(r"fault_tolerance: sync_every 6 must be a multiple of fragments 4", algorithm="diloco", sync_every=6,
            fragments=4)
    refused(r"fault_tolerance: fragment_sync_delay 2 must be less than sync_every / fragments = 2",
            algorithm="diloco", sync_every=4, fragments=2, fragment_sync_delay=2)
    refused(r"fault_tolerance.algorithm.*'gossip'", algorithm="gossip")
    cfg = load_config({"train_batch_size": 2, "fault_tolerance": {"enabled": True, "algorithm": "diloco",
                                                                  "sync_every": 4, "fragments": 2}})
    outer = cfg.fault_tolerance.outer_optimizer  # the DiLoCo paper's outer optimizer by default
    assert outer.type == "SGD" and outer.params == {"lr": 0.7, "momentum": 0.9, "nesterov": True}


def _refusal_body(rank, world_size):
    """Combinations torchft's LocalSGD / DiLoCo cannot run on are refused at initialize, by key."""
    import torch

    import shardwise
    from shardwise.config import ConfigError as Refused

    os.environ["TORCHFT_LIGHTHOUSE"] = "127.0.0.1:1"  # (never reached: refused before)
    out = []
    for extra in ({"fp16": {"enabled": True}},
                  {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}):
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "fault_tolerance": {"enabled": True, "algorithm": "local_sgd", "sync_every": 2}, **extra}
        try:
            shardwise.initialize(model=torch.nn.Linear(2, 1), config=config)
            out.append("initialized")
        except Refused as exc:
            out.append(str(exc))
    return out


def test_periodic_sync_refuses_fp16_and_offload():
    from distributed import run_distributed

    (fp16, offload), = run_distributed(_refusal_body, 1, timeout=120)
    assert "fault_tolerance.algorithm 'local_sgd' with fp16.enabled" in fp16, fp16
    assert "fault_tolerance.algorithm 'local_sgd' with zero_optimization.offload_optimizer.device 'cpu'" in offload, offload


@slow_launches
def test_local_sgd_and_diloco_on_two_replica_groups(tmp_path):
    """2 replica groups x 1 process, plain SGD, every step's weights and gradients recorded. LocalSGD with
    sync_every=1 is the ddp path's step: averaging the weights each group stepped = stepping the averaged
    gradient. DiLoCo with sync_every=2 steps alone in between and, at each synchronisation, applies the
    outer Nesterov step to the averaged pseudo-gradient exactly as computed here from the inner steps.
    Beside them, 2 groups x 2 processes at ZeRO-3: LocalSGD every step on the shards ends where ddp does."""
    import torch

    lr, steps = 0.05, 4
    runs = {"local_sgd": ["--sync_every", "1"], "diloco": ["--sync_every", "2"]}
    outs = {name: tmp_path / name for name in runs}
    jobs = {name: _start(outs[name], steps, "--sgd", str(lr), "--algorithm", name, "--trace", *extra, restarts=0)
            for name, extra in runs.items()}
    # ZeRO-3 inside groups of 2 processes: LocalSGD every step, on this rank's shards, = the ddp path
    z3 = {name: tmp_path / f"{name}_zero3" for name in ("ddp", "local_sgd")}
    z3_jobs = {name: _start(out, steps, "--sgd", str(lr), "--algorithm", name, "--stage", "3",
                            *(["--sync_every", "1"] if name == "local_sgd" else []), procs=2, restarts=0)
               for name, out in z3.items()}
    for name, job in jobs.items():
        _ok(job, outs[name])
    for name, job in z3_jobs.items():
        _ok(job, z3[name])
    z3_final = {}
    for name, out in z3.items():
        r = _records(out)
        every = [r[g, k, 0]["params"] for g in (0, 1) for k in (0, 1)]
        assert all(p == every[0] for p in every), f"{name} at ZeRO-3: the ranks' weights differ"
        z3_final[name] = torch.tensor([v for values in every[0].values() for v in values])
    torch.testing.assert_close(z3_final["local_sgd"], z3_final["ddp"], rtol=0, atol=1e-6)
    recs = {name: _records(out) for name, out in outs.items()}
    traces = {}
    for name, r in recs.items():
        assert r[0, 0, 0]["final_step"] == r[1, 0, 0]["final_step"] == steps
        assert r[0, 0, 0]["params"] == r[1, 0, 0]["params"], f"{name}: the replica groups' weights differ"
        traces[name] = (r[0, 0, 0]["trace"], r[1, 0, 0]["trace"])
        for t in traces[name]:  # nothing but the engine's steps changed the weights (no peer's state on the way)
            assert all(t[s]["before"] == t[s - 1]["after"] for s in range(1, steps)), name

    T = torch.tensor
    t0, t1 = traces["local_sgd"]
    assert (z3_final["ddp"] - T(t0[0]["before"])).abs().max() > 1e-3  # (the ZeRO-3 jobs trained)
    for s in range(steps):  # the ddp path's update, from the same weights and the two groups' gradients
        assert t0[s]["before"] == t1[s]["before"] and t0[s]["after"] == t1[s]["after"]
        ddp = T(t0[s]["before"]) - lr * (T(t0[s]["grad"]) + T(t1[s]["grad"])) / 2
        torch.testing.assert_close(T(t0[s]["after"]), ddp, rtol=0, atol=1e-6)
        assert (T(t0[s]["after"]) - (T(t0[s]["before"]) - lr * T(t0[s]["grad"]))).abs().max() > 1e-4

    # DiLoCo by hand: inner SGD steps; at steps 1 and 3 the outer step on the mean pseudo-gradient
    t0, t1 = traces["diloco"]
    orig = T(t0[0]["before"])
    assert t1[0]["before"] == t0[0]["before"]
    buf = None
    for s in range(steps):
        local = [T(t[s]["before"]) - lr * T(t[s]["grad"]) for t in (t0, t1)]
        if s % 2 == 0:  # an inner step alone: the groups part
            for t, want in zip((t0, t1), local):
                torch.testing.assert_close(T(t[s]["after"]), want, rtol=0, atol=1e-6)
            assert t0[s]["after"] != t1[s]["after"]
            continue
        pseudo = ((orig - local[0]) + (orig - local[1])) / 2
        buf = pseudo.clone() if buf is None else 0.9 * buf + pseudo
        orig = orig - 0.7 * (pseudo + 0.9 * buf)
        for t in (t0, t1):
            torch.testing.assert_close(T(t[s]["after"]), orig, rtol=0, atol=1e-6)
