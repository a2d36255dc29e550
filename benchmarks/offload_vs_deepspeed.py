"""ZeRO-2 and ZeRO-3 with the optimizer offloaded to the CPU: shardwise against DeepSpeed 0.19.

    python benchmarks/offload_vs_deepspeed.py [--layers 8] [--width 512] [--steps 12] [--rounds 2] \
        [--dsvenv /work/dsvenv]

The same script trains the same GPT (examples/gpt/model.py, plain torch) with the same config,
once with ``import deepspeed`` (run by ``--dsvenv``'s torchrun, ``DS_ACCELERATOR=cpu``: its
ZeRO-Offload builds DeepSpeedCPUAdam from the ``AdamW`` block) and once with
``import shardwise as deepspeed`` (this checkout, the shared venv), 2 processes each, taking
turns in every round.  Reported: the median step time after 2 warm-up steps (best round) and
shardwise's time as a fraction of DeepSpeed's (required: <= 1.0x, goal: <= 0.9x).
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


def _config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"},
                              "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7,
                              "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e4},
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
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=_config(args.stage))
    g = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(args.steps):
        x = torch.randint(0, 256, (4, 128), generator=g)
        t0 = time.perf_counter()
        loss = lm_loss(engine(x), x)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        params = sum(p.numel() for p in model.parameters())
        with open(args.out, "w") as f:
            json.dump({"times": times, "loss": loss.item(), "params": params}, f)
    torch.distributed.destroy_process_group()


def _run(framework: str, stage: int, args) -> dict:
    venv = args.dsvenv if framework == "deepspeed" else os.path.dirname(os.path.dirname(sys.executable))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    if framework == "deepspeed":
        env.pop("PYTHONPATH", None)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        out = tmp.name
    cmd = [os.path.join(venv, "bin", "torchrun"), "--nproc_per_node", "2", "--master_port", str(args.port),
           os.path.abspath(__file__), "--worker", "--framework", framework, "--stage", str(stage),
           "--layers", str(args.layers), "--width", str(args.width), "--steps", str(args.steps), "--out", out]
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
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=29517)
    ap.add_argument("--dsvenv", default="/work/dsvenv")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    best: dict[tuple[str, int], float] = {}
    losses: dict[tuple[str, int], float] = {}
    params = 0
    for r in range(args.rounds):
        for stage in (2, 3):
            for framework in ("deepspeed", "shardwise"):
                res = _run(framework, stage, args)
                t = statistics.median(res["times"][2:])
                best[framework, stage] = min(best.get((framework, stage), float("inf")), t)
                losses[framework, stage] = res["loss"]
                params = res["params"]
                print(f"round {r + 1} stage {stage} {framework}: {t * 1e3:.0f} ms/step", flush=True)
    print(f"\nGPT {args.layers} layers x {args.width} ({params / 1e6:.1f}M parameters), 2 processes, "
          f"micro-batch 4 x 128 tokens, AdamW offloaded to the CPU, best of {args.rounds} rounds")
    print("| configuration | DeepSpeed 0.19 (ms/step) | shardwise (ms/step) | shardwise / DeepSpeed | "
          "final loss DS / shardwise |")
    print("|---|---|---|---|---|")
    for stage in (2, 3):
        ds, sw = best["deepspeed", stage], best["shardwise", stage]
        print(f"| ZeRO-{stage} + offload_optimizer cpu | {ds * 1e3:.0f} | {sw * 1e3:.0f} | {sw / ds:.2f}x | "
              f"{losses['deepspeed', stage]:.4f} / {losses['shardwise', stage]:.4f} |")


if __name__ == "__main__":
    main()
