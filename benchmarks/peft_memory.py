"""Live tensor bytes per rank of LoRA (peft) against full fine-tuning at ZeRO stages 0-3.

    python benchmarks/peft_memory.py [--procs 2] [--steps 2] [--layers 2] [--hidden 128] [--ckpt nonreentrant]

A Llama built locally (2 layers, width 128, 4 query heads and 2 key/value heads, vocabulary 1024: 0.56M
parameters), fp32, AdamW, activation checkpointing (non-reentrant by default), ZeRO-3 unit sizes as
transformers fills "auto"; LoRA r=8 on every attention and MLP projection (peft). Each (tuning, stage)
runs in its own fresh set of gloo processes. Measured as in benchmarks/zero_memory.py: the largest sum of
the distinct tensor storages Python can reach (``shardwise.profiling.LiveTensorPeak``), over every step
after the first, "at the step" (between backward and the optimizer step: model states and ZeRO's buffers)
and "peak in backward" (also sampled after each gradient is accumulated: adds gathered ZeRO-3 units,
gradient buckets in flight and activations). One sequence of 16 tokens per rank keeps activations small.
Bytes, not time: the machine's load does not change them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from zero_vs_ddp import _free_port, join_gloo  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _worker(rank: int, world: int, port: int, tuning: str, stage: int, args, out_dir: str) -> None:
    join_gloo(rank, world, port)
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import shardwise
    from shardwise.profiling import LiveTensorPeak

    torch.manual_seed(0)
    h = args.hidden
    model = LlamaForCausalLM(LlamaConfig(vocab_size=args.vocab, hidden_size=h, intermediate_size=2 * h,
                                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64, use_cache=False))
    psi = sum(p.numel() for p in model.parameters())
    if args.ckpt != "none":
        reentrant = args.ckpt == "reentrant"
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    if tuning == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    zero = {"stage": stage, "reduce_bucket_size": h * h}
    if stage == 3:  # what transformers writes for "auto"
        zero.update({"stage3_prefetch_bucket_size": int(0.9 * h * h), "stage3_param_persistence_threshold": 10 * h})
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    peak, at_step = LiveTensorPeak(), LiveTensorPeak()
    g = torch.Generator().manual_seed(1 + rank)
    for i in range(args.steps):
        if i == 1:  # from the second step on: the optimizer's states exist
            peak.watch(engine.module)
        ids = torch.randint(0, args.vocab, (1, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        del loss
        if i >= 1:
            peak.sample()
            at_step.sample()
        engine.step()
        if i >= 1:
            peak.sample()
    peak.close()
    with open(os.path.join(out_dir, f"{rank}"), "w") as f:
        f.write(f"{psi} {trainable} {peak.bytes} {at_step.bytes}\n")
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--tunings", nargs="+", default=["full", "lora"], choices=["full", "lora"])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--ckpt", default="nonreentrant", choices=["none", "reentrant", "nonreentrant"])
    args = ap.parse_args()
    mib = 2**20
    header = False
    for tuning in args.tunings:
        for stage in args.stages:
            with tempfile.TemporaryDirectory() as out:
                mp.start_processes(_worker, args=(args.procs, _free_port(), tuning, stage, args, out),
                                   nprocs=args.procs, start_method="spawn")
                got = [open(os.path.join(out, str(r))).read().split() for r in range(args.procs)]
            psi, trainable = int(got[0][0]), int(got[0][1])
            peaks, steps = [int(x[2]) for x in got], [int(x[3]) for x in got]
            if not header:
                print(f"Llama {args.layers} layers, width {args.hidden}, 2 key/value heads: {psi / 1e6:.2f}M "
                      f"parameters, fp32 AdamW, checkpointing {args.ckpt}, {args.procs} gloo ranks, "
                      f"torch {torch.__version__}")
                print("| tuning | trainable | stage | at the step, per rank (MiB) | peak in backward, per rank (MiB) |")
                print("|---|---|---|---|---|", flush=True)
                header = True
            print(f"| {tuning} | {trainable / 1e6:.3f}M | {stage} | {' / '.join(f'{p / mib:.2f}' for p in steps)} | "
                  f"{' / '.join(f'{p / mib:.2f}' for p in peaks)} |", flush=True)

if __name__ == "__main__":
    main()
