"""GPU check: the engine at ZeRO 0-3, with and without CPU offload, against a plain torch loop, on one device.

    python benchmarks/gpu_check.py                      # CUDA; exits 0 with a message when there is none
    python benchmarks/gpu_check.py --device cpu --size tiny --steps 4   # dry run of the same logic on the CPU
    make gpu-check

The model is the demo GPT (examples/gpt/model.py) in bf16 (``--dtype fp32`` for an exact comparison).
The reference is a plain torch loop on the same weights and batches: 16-bit parameters for forward and
backward, fp32 master weights stepped by ``torch.optim.AdamW``, the gradient clipped to norm 1 (what
the engine's bf16 mode does). Each engine run: ZeRO 0, 1, 2, 3, then ZeRO 1-3 with the optimizer (and,
at 3, the parameters) offloaded to pinned CPU memory. Per run: the largest relative loss difference
from the torch loop over all steps (bf16: within 5e-3; fp32: 1e-5), median step time after warm-up,
tokens/s and model FLOPs utilisation: 6 x (parameters in matmuls) + 12 x layers x width x sequence
FLOPs per token (PaLM's count, causal attention counted whole) over the device's dense bf16 peak
(known for H100/H200/A100/L4, else ``--peak-tflops``). Everything runs in one process on ``--device``:
the code path is the same for the CPU and CUDA, only the device object differs.

Then ``engine.offload_states()`` at ZeRO 1-3 (runs "offload_states ZeRO-k"): after two steps, the bytes
allocated on the device before ``offload_states()``, after it and after ``reload_states()``; the bytes it
freed are checked against ZeRO's model-state formula for one rank, 16 bytes per trainable parameter
(2 weights + 2 gradients + 4 fp32 master + 8 Adam moments in bf16; fp32: 4 + 4 + 8), within 10%, and the
reload must bring the same bytes back (within 1%), after which a step trains on. On CUDA the bytes are
``torch.cuda.memory_allocated()``; on the CPU (dry run) the bytes of the live tensors on the device, less
the host copies the offload made.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))
sys.path.insert(0, ROOT)

SIZES = {  # GPTConfig keywords and the micro-batch
    "tiny": (dict(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=32), 2),
    "demo": (dict(), 8),  # examples/gpt's own GPTConfig
    "gpt2": (dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), 8),
}
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L4": 121.0}  # dense, SXM parts
LR, CLIP = 3e-4, 1.0
RUNS = [  # (label, zero stage, offload)
    ("ZeRO-0", 0, False), ("ZeRO-1", 1, False), ("ZeRO-2", 2, False), ("ZeRO-3", 3, False),
    ("ZeRO-1 + offload", 1, True), ("ZeRO-2 + offload", 2, True), ("ZeRO-3 + offload", 3, True),
]
OFFLOAD_STATES_RUNS = [("offload_states ZeRO-1", 1), ("offload_states ZeRO-2", 2), ("offload_states ZeRO-3", 3)]


def _model(size: str, dtype: torch.dtype, device: torch.device):
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(**SIZES[size][0])).to(device=device, dtype=dtype)


def _batches(cfg, micro: int, steps: int, device: torch.device):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        t = torch.randint(cfg.vocab_size, (micro, cfg.block_size + 1), generator=g)
        yield t[:, :-1].to(device), t[:, 1:].to(device)


def _timed(step, batches, sync) -> tuple[list[float], list[float]]:
    losses, times = [], []
    for x, y in batches:
        sync()
        t0 = time.perf_counter()
        loss = step(x, y)
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return losses, times


def torch_loop(args, device, sync):
    """The reference: 16-bit forward/backward, fp32 master weights, torch's AdamW, clip to norm 1."""
    from model import lm_loss

    model = _model(args.size, args.dtype, device)
    masters = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.01)

    def step(x, y):
        loss = lm_loss(model(x), y)
        loss.backward()
        for m, p in zip(masters, model.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(masters, model.parameters()):
                p.copy_(m)
        return loss

    return _timed(step, _batches(model.cfg, SIZES[args.size][1], args.steps, device), sync)


def engine_run(args, device, sync, *, stage: int, offload: bool):
    import shardwise
    from model import lm_loss

    model = _model(args.size, torch.float32, device)  # the engine casts to the training dtype itself
    zero = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = {"train_micro_batch_size_per_gpu": SIZES[args.size][1], "gradient_clipping": CLIP,
           "bf16": {"enabled": args.dtype == torch.bfloat16},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "zero_optimization": zero}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    if engine.device.type != device.type:
        raise SystemExit(f"gpu_check: the engine chose {engine.device} but --device is {device}")

    def step(x, y):
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    out = _timed(step, _batches(model.cfg, SIZES[args.size][1], args.steps, device), sync)
    engine.destroy()
    return out


def _device_bytes(engine, device: torch.device) -> int:
    """Bytes allocated on ``device``: the CUDA allocator's count; on the CPU the unique storages of the live
    tensors there, less the host copies ``offload_states`` made (they are where the states went)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    from shardwise.profiling.memory import collect_garbage

    offload = engine.__dict__.get("_state_offload")
    seen = {p.host.untyped_storage()._cdata for ps in (offload.parked.values() if offload else ()) for p in ps}
    collect_garbage()  # (every pass: what one frees can hold the garbage of the next)
    total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (isinstance on deprecated module attributes warns)
        for o in gc.get_objects():
            # (by the storage's device: a fake tensor torch.compile keeps says "cpu" but holds no memory, and
            # its symbolic size is no byte count)
            if isinstance(o, torch.Tensor) and o.device == device:
                st = o.untyped_storage()
                if st.device == device and st._cdata not in seen:
                    seen.add(st._cdata)
                    total += st.nbytes()
    return total


def offload_states_run(args, device, sync, *, stage: int) -> dict:
    """Bytes on the device before ``offload_states()``, after it and after ``reload_states()``, and ZeRO's
    model-state bytes for one rank (16 per trainable parameter); then a step after the reload."""
    import shardwise
    from model import lm_loss

    model = _model(args.size, torch.float32, device)
    cfg = {"train_micro_batch_size_per_gpu": SIZES[args.size][1], "gradient_clipping": CLIP,
           "bf16": {"enabled": args.dtype == torch.bfloat16},
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage}}
    engine, *_ = shardwise.initialize(model=model, config=cfg)
    batches = list(_batches(model.cfg, SIZES[args.size][1], 3, device))
    for x, y in batches[:2]:
        engine.backward(lm_loss(engine(x), y))
        engine.step()
    engine.empty_partition_cache()
    gc.collect()
    before = _device_bytes(engine, device)
    engine.offload_states()
    offloaded = _device_bytes(engine, device)
    engine.reload_states()
    reloaded = _device_bytes(engine, device)
    x, y = batches[2]
    loss = lm_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    sync()
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad)
    formula = 16 * params
    engine.destroy()
    return {"before": before, "offloaded": offloaded, "reloaded": reloaded, "formula": formula,
            "loss": float(loss.detach())}


def flops_per_token(size: str) -> float:
    from model import GPT, GPTConfig

    cfg = GPTConfig(**SIZES[size][0])
    with torch.device("meta"):
        model = GPT(cfg)
    matmul = sum(p.numel() for p in model.parameters()) - model.tok.weight.numel() - model.pos.weight.numel()
    return 6 * matmul + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def peak_tflops(args, device) -> float | None:
    if args.peak_tflops is not None:
        return args.peak_tflops
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


MFU_LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
MFU_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)


def mfu_check(args, device, sync) -> int:
    """The MFU the engine logs (``steps_per_print``), next to one computed here from scratch: a Llama-shaped
    model (transformers, SDPA attention) in bf16 at ZeRO-0 on one device; our count of FLOPs per token is
    6 x (every parameter but the input embedding) + 12 x layers x hidden x sequence, over the median step time
    measured with device synchronisation, over the peak the engine uses."""
    import logging

    import shardwise
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shardwise.monitor.mfu import device_name, peak_flops

    tiny = device.type != "cuda"
    shape = MFU_TINY if tiny else MFU_LLAMA
    seq, micro, steps, every = (32, 2, 6, 2) if tiny else (2048, 8, 30, 10)
    cfg = LlamaConfig(**shape, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(device)
    ds = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": every, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 0}}
    if args.peak_tflops:
        ds["peak_tflops"] = args.peak_tflops
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append(rec.getMessage())
    logging.getLogger("shardwise").addHandler(handler)
    engine, *_ = shardwise.initialize(model=model, config=ds)
    g = torch.Generator().manual_seed(1)
    times = []
    for _ in range(steps):
        ids = torch.randint(cfg.vocab_size, (micro, seq), generator=g).to(device)
        sync()
        t0 = time.perf_counter()
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        sync()
        times.append(time.perf_counter() - t0)
    logging.getLogger("shardwise").removeHandler(handler)
    logged = [ln for ln in lines if ln.startswith("step=")]
    t = statistics.median(times[every:])
    n = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    fpt = 6 * n + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq
    peak, source = peak_flops(device_name(engine.device), "bf16", override_tflops=args.peak_tflops)
    ours = micro * seq / t * fpt / peak if peak else None
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\nMFU check: {name}, Llama-shaped {n / 1e6:.0f}M parameters in matmuls, bf16, {micro} x {seq} tokens "
          f"per step, peak {source}")
    print(f"engine log: {logged[-1] if logged else '(no steps_per_print line)'}")
    print(f"independent: median step {t * 1e3:.1f} ms, tokens/s {micro * seq / t:,.0f}, "
          f"MFU {f'{ours:.1%}' if ours is not None else 'n/a (no peak)'}")
    print("reference points: torchtitan Llama-3.1-8B on H100, 33-39% MFU; Megatron-Core, 47%")
    if not logged or "tokens/sec=" not in logged[-1]:
        print("gpu_check: the engine logged no tokens/sec")
        return 1
    if ours is not None:
        if "MFU=" not in logged[-1]:
            print("gpu_check: the engine logged no MFU")
            return 1
        engine_mfu = float(logged[-1].split("MFU=")[1].split("%")[0]) / 100
        if abs(engine_mfu - ours) > 0.15 * ours:
            print(f"gpu_check: logged MFU {engine_mfu:.1%} and independent {ours:.1%} differ by more than 15%")
            return 1
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=list(SIZES), default="gpt2")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense peak of the device in the dtype")
    ap.add_argument("--runs", nargs="+", default=[r[0] for r in RUNS + OFFLOAD_STATES_RUNS],
                    help="labels of the engine runs to do")
    ap.add_argument("--mfu", action="store_true", help="instead: the MFU the engine logs vs an independent count")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: skipped, no CUDA device (torch.cuda.is_available() is False); "
              "`--device cpu --size tiny` runs the same checks on the CPU")
        return 0
    if args.steps <= args.warmup:
        raise SystemExit(f"gpu_check: --steps ({args.steps}) must exceed --warmup ({args.warmup})")
    args.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    tol = 5e-3 if args.dtype == torch.bfloat16 else 1e-5
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        if device.index is None:  # "cuda" alone: the current device
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    if args.mfu:
        return mfu_check(args, device, sync)
    from model import GPTConfig

    tokens = SIZES[args.size][1] * GPTConfig(**SIZES[args.size][0]).block_size
    fpt, peak = flops_per_token(args.size), peak_tflops(args, device)

    ref_losses, ref_times = torch_loop(args, device, sync)
    rows = [("plain torch", ref_times, 0.0)]
    for label, stage, offload in RUNS:
        if label not in args.runs:
            continue
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        losses, times = engine_run(args, device, sync, stage=stage, offload=offload)
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        rows.append((label, times, diff))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"\n{name}, demo GPT size {args.size} ({fpt / 6 / 1e6:.2f}M parameters in matmuls), "
          f"{str(args.dtype).removeprefix('torch.')}, {tokens} tokens per step, {args.steps} steps "
          f"({args.warmup} warm-up), torch {torch.__version__}")
    print("| run | step (ms) | tokens/s | MFU | max rel. loss diff vs torch | ok |")
    print("|---|---|---|---|---|---|")
    failed = []
    for label, times, diff in rows:
        t = statistics.median(times[args.warmup:])
        mfu = f"{tokens / t * fpt / (peak * 1e12):.1%}" if peak else "n/a"
        ok = diff <= tol
        failed += [] if ok else [label]
        print(f"| {label} | {t * 1e3:.1f} | {tokens / t:,.0f} | {mfu} | {diff:.2e} | {'yes' if ok else 'NO'} |")
    states = [(label, stage) for label, stage in OFFLOAD_STATES_RUNS if label in args.runs]
    if states:
        print("\n| run | allocated before (MB) | after offload_states (MB) | freed (MB) | model-state formula (MB) "
              "| after reload_states (MB) | ok |")
        print("|---|---|---|---|---|---|---|")
    for label, stage in states:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = offload_states_run(args, device, sync, stage=stage)
        freed = r["before"] - r["offloaded"]
        ok = (abs(freed - r["formula"]) <= 0.1 * r["formula"]
              and abs(r["reloaded"] - r["before"]) <= 0.01 * r["formula"] and r["loss"] == r["loss"])
        failed += [] if ok else [label]
        mb = 1e6
        print(f"| {label} | {r['before'] / mb:.1f} | {r['offloaded'] / mb:.1f} | {freed / mb:.1f} | "
              f"{r['formula'] / mb:.1f} | {r['reloaded'] / mb:.1f} | {'yes' if ok else 'NO'} |")
    if failed:
        print(f"gpu_check: failed: {', '.join(failed)} (losses differ from the torch loop by more than {tol:g}, or "
              "offload_states did not free the model states / reload_states did not bring them back)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
