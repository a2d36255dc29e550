"""ZeRO-2 and ZeRO-3 with the optimizer offloaded to the CPU: shardwise against DeepSpeed 0.19.

    python benchmarks/offload_vs_deepspeed.py [--layers 8] [--width 512] [--steps 12] [--rounds 2] \
        [--dsvenv /work/dsvenv] [--clip 1.0 0.0] [--device cpu|nvme --nvme-path DIR]

The same script trains the same GPT (examples/gpt/model.py, plain torch) with the same config,
once with ``import deepspeed`` (run by ``--dsvenv``'s torchrun, ``DS_ACCELERATOR=cpu``: its
ZeRO-Offload builds DeepSpeedCPUAdam from the ``AdamW`` block) and once with
``import shardwise as deepspeed`` (this checkout, the shared venv), 2 processes each, taking
turns in every round.  Reported: the median step time after 2 warm-up steps (best round) and
shardwise's time as a fraction of DeepSpeed's (required: <= 1.0x, goal: <= 0.9x), and the median
time of the ``engine.step()`` call alone (what is left after backward).

Each ``--clip`` value is one configuration (``gradient_clipping``): with 0 shardwise steps the
offloaded optimizer during backward, sub-group by sub-group; with clipping the step needs the global
norm and runs after backward.  "shardwise, no overlap" is the same run with that overlap switched
off (``engine.strategy.partition.overlap_step = False``).  ``--device nvme`` offloads the optimizer
to ``--nvme-path`` instead; DeepSpeed is then left out when its ``async_io`` op cannot be built.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(stage: int, clip: float, device: str, nvme_path: str | None) -> dict:
    offload = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=nvme_path, buffer_count=4)
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "offload_optimizer": offload,
                              "reduce_bucket_size": 5e6, "allgather_bucket_size": 5e7, "sub_group_size": 2e6,
                              "stage3_prefetch_bucket_size": 5e6, "stage3_param_persistence_threshold": 1e4},
    }


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    if args.framework == "deepspeed":
        import deepspeed
    else:
        sys.path.insert(0, ROOT)
        import shardwise as deepspeed
    sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
    from model import GPT, GPTConfig, lm_loss

    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=args.layers, n_head=8, n_embd=args.width))
    cfg = _config(args.stage, args.clip, args.device, args.nvme_path)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if args.framework == "shardwise-no-overlap":
        engine.strategy.partition.overlap_step = False
    g = torch.Generator().manual_seed(rank)
    times, step_times = [], []
    for _ in range(args.steps):
        x = torch.randint(0, 256, (4, 128), generator=g)
        t0 = time.perf_counter()
        loss = lm_loss(engine(x), x)
        engine.backward(loss)
        t1 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        step_times.append(time.perf_counter() - t1)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        with open(args.out, "w") as f:
            json.dump({"times": times, "step_times": step_times, "loss": loss.item(), "params": params}, f)
    torch.distributed.destroy_process_group()


def _run(framework: str, stage: int, clip: float, args) -> dict:
    venv = args.dsvenv if framework == "deepspeed" else os.path.dirname(os.path.dirname(sys.executable))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    if framework == "deepspeed":
        env.pop("PYTHONPATH", None)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    cmd = [os.path.join(venv, "bin", "torchrun"), "--nproc_per_node", "2", "--master_port", str(args.port),
           os.path.abspath(__file__), "--worker", "--framework", framework, "--stage", str(stage),
           "--layers", str(args.layers), "--width", str(args.width), "--steps", str(args.steps), "--out", out,
           "--clip", str(clip), "--device", args.device]
    if args.nvme_path:
        cmd += ["--nvme-path", args.nvme_path]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{framework} stage {stage} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--framework", default="shardwise")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--dsvenv", default="/work/dsvenv")
    ap.add_argument("--clip", type=float, nargs="+", default=[1.0, 0.0])
    ap.add_argument("--device", choices=["cpu", "nvme"], default="cpu")
    ap.add_argument("--nvme-path", default=None)
    args = ap.parse_args()
    if args.worker:
        args.clip = args.clip[0]
        worker(args)
        return
    if args.device == "nvme" and not args.nvme_path:
        ap.error("--device nvme needs --nvme-path")
    frameworks = ["deepspeed", "shardwise", "shardwise-no-overlap"]
    if args.device == "nvme" and not _deepspeed_aio(args.dsvenv):
        print("DeepSpeed's async_io op is not buildable here (libaio): comparing shardwise with itself only")
        frameworks.remove("deepspeed")
    best: dict[tuple, tuple[float, float]] = {}
    losses: dict[tuple, float] = {}
    params = 0
    for r in range(args.rounds):
        for stage in (2, 3):
            for clip in args.clip:
                for framework in frameworks:
                    res = _run(framework, stage, clip, args)
                    t, ts = statistics.median(res["times"][2:]), statistics.median(res["step_times"][2:])
                    key = (framework, stage, clip)
                    if t < best.get(key, (float("inf"), 0.0))[0]:
                        best[key] = (t, ts)
                    losses[key] = res["loss"]
                    params = res["params"]
                    print(f"round {r + 1} stage {stage} clip {clip} {framework}: {t * 1e3:.0f} ms/step, "
                          f"engine.step() {ts * 1e3:.0f} ms", flush=True)
    print(f"\nGPT {args.layers} layers x {args.width} ({params / 1e6:.1f}M parameters), 2 processes, "
          f"micro-batch 4 x 128 tokens, AdamW offloaded to {args.device}, best of {args.rounds} rounds")
    names = {"deepspeed": "DeepSpeed 0.19.8", "shardwise": "shardwise", "shardwise-no-overlap": "shardwise, no overlap"}
    print("| configuration | " + " | ".join(f"{names[f]} ms/step (step() ms)" for f in frameworks)
          + (" | shardwise / DeepSpeed" if "deepspeed" in frameworks else "") + " | final loss |")
    print("|---" * (len(frameworks) + 2 + ("deepspeed" in frameworks)) + "|")
    for stage in (2, 3):
        for clip in args.clip:
            row = [best[(f, stage, clip)] for f in frameworks]
            cells = [f"{t * 1e3:.0f} ({ts * 1e3:.0f})" for t, ts in row]
            if "deepspeed" in frameworks:
                cells.append(f"{row[1][0] / row[0][0]:.2f}x")
            loss = " / ".join(f"{losses[(f, stage, clip)]:.4f}" for f in frameworks)
            print(f"| ZeRO-{stage}, offload {args.device}, clipping {clip:g} | " + " | ".join(cells) + f" | {loss} |")


def _deepspeed_aio(dsvenv: str) -> bool:
    code = "from deepspeed.ops.op_builder import AsyncIOBuilder; print(AsyncIOBuilder().is_compatible(verbose=False))"
    out = subprocess.run([os.path.join(dsvenv, "bin", "python"), "-c", code], capture_output=True, text=True,
                         env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return out.stdout.strip().endswith("True")


if __name__ == "__main__":
    main()
