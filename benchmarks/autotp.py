"""AutoTP training of a small Llama: shardwise vs DeepSpeed 0.19.8, tensor-parallel size 2.

    python benchmarks/autotp.py [--steps 30] [--repeats 3] [--zero 1] [--ds-venv /work/dsvenv]

The driver saves one random Llama (grouped key/value heads) with ``save_pretrained``; every run
loads it with ``from_pretrained`` and trains the same batches through ``initialize`` with
``{"tensor_parallel": {"autotp_size": 2}}`` in two processes launched by torchrun: once with
``import shardwise as deepspeed`` (this tree, the shared venv) and once with DeepSpeed 0.19.8
(its venv, ``DS_ACCELERATOR=cpu``). The runs alternate, so machine load hits both. Per run: median
step time of rank 0 after warm-up, peak resident memory per rank, and the losses (which must
agree between the frameworks: same model, same data, same math). The table shows medians over
the repetitions and the ratio shardwise / DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)
MICRO, SEQ, LR = 4, 128, 1e-3
WARMUP = 5


def _config(zero: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "zero_optimization": {"stage": zero},
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "tensor_parallel": {"autotp_size": 2}, "steps_per_print": 10**9}


def worker(args) -> None:
    import torch

    if args.framework == "deepspeed":
        import deepspeed
    else:
        import shardwise as deepspeed
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    deepspeed.init_distributed(dist_backend="gloo")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
    config = _config(args.zero)
    if args.framework == "deepspeed":
        config["optimizer"]["params"]["torch_adam"] = True  # DeepSpeed's FusedAdam is CUDA-only
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(0)
    times, losses = [], []
    for _ in range(args.steps):
        ids = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=g)  # same batch on both tensor ranks
        t = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    rank = int(os.environ["RANK"])
    out = {"step_s": statistics.median(times[WARMUP:]), "losses": losses,
           "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    with open(os.path.join(args.out, f"{args.framework}-{rank}.json"), "w") as f:
        json.dump(out, f)


def _launch(framework: str, model_dir: str, out: str, steps: int, zero: int, ds_venv: str) -> dict:
    venv = ds_venv if framework == "deepspeed" else os.path.dirname(os.path.dirname(sys.executable))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if framework == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = ROOT
    cmd = [os.path.join(venv, "bin", "python"), "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_port", str(29500 + os.getpid() % 1000), os.path.abspath(__file__), "--worker",
           "--framework", framework, "--model", model_dir, "--out", out, "--steps", str(steps), "--zero", str(zero)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    ranks = [json.load(open(os.path.join(out, f"{framework}-{r}.json"))) for r in range(2)]
    return {"step_s": ranks[0]["step_s"], "rss_mib": [r["rss_mib"] for r in ranks], "losses": ranks[0]["losses"]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--framework", choices=("shardwise", "deepspeed"))
    p.add_argument("--model")
    p.add_argument("--out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--ds-venv", default="/work/dsvenv")
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model_dir = os.path.join(tmp, "llama")
        LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(model_dir)
        n_params = sum(p.numel() for p in LlamaForCausalLM.from_pretrained(model_dir).parameters())
        runs = {"shardwise": [], "deepspeed": []}
        for rep in range(args.repeats):
            for fw in ("shardwise", "deepspeed") if rep % 2 == 0 else ("deepspeed", "shardwise"):
                runs[fw].append(_launch(fw, model_dir, tmp, args.steps, args.zero, args.ds_venv))
                print(f"repeat {rep} {fw}: {runs[fw][-1]['step_s']:.4f} s/step", file=sys.stderr)
    step = {fw: statistics.median(r["step_s"] for r in rs) for fw, rs in runs.items()}
    rss = {fw: [statistics.median(r["rss_mib"][i] for r in rs) for i in range(2)] for fw, rs in runs.items()}
    la, lb = runs["shardwise"][0]["losses"], runs["deepspeed"][0]["losses"]
    max_rel = max(abs(a - b) / abs(b) for a, b in zip(la, lb))
    print(f"Llama {n_params / 1e6:.1f}M params ({MODEL['num_attention_heads']} heads, "
          f"{MODEL['num_key_value_heads']} kv heads), micro-batch {MICRO} x {SEQ} tokens, ZeRO {args.zero}, "
          f"autotp_size 2, {args.steps} steps (median after {WARMUP}), {args.repeats} repeats\n")
    print("| framework | step (s), median | each repeat (s) | ratio vs DeepSpeed | peak RSS rank 0 / 1 (MiB) "
          "| loss step 1 | loss last |")
    print("|---|---|---|---|---|---|---|")
    for fw in ("shardwise", "deepspeed"):
        losses = runs[fw][0]["losses"]
        each = " / ".join(f"{r['step_s']:.3f}" for r in runs[fw])
        print(f"| {fw} | {step[fw]:.4f} | {each} | {step[fw] / step['deepspeed']:.2f} | "
              f"{rss[fw][0]:.0f} / {rss[fw][1]:.0f} | {losses[0]:.5f} | {losses[-1]:.5f} |")
    print(f"\nlargest relative loss difference shardwise vs DeepSpeed over {len(la)} steps: {max_rel:.2e}")


if __name__ == "__main__":
    main()
