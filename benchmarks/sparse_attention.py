"""Block-sparse (SparseSelfAttention, flex_attention) vs dense attention time.

    python benchmarks/sparse_attention.py [--seqs 4096 16384] [--heads 4] [--head-dim 64]
                                          [--block 64] [--local-blocks 16] [--repeat 3] [--json out.json]

The sparse side is ``SparseSelfAttention`` with a bidirectional ``FixedSparsityConfig``
(``--local-blocks`` blocks per local window, one global block per window; at 16384 tokens and
block 64 that is 1/8 of the blocks), compiled flex_attention (torch.compile; the first call
compiles and is not timed).  The dense side is ``torch.nn.functional.scaled_dot_product_attention``
(torch's fused CPU kernel, no mask).  Both run on the same inputs in the same process, one after
the other, alternating, so machine load affects both; the ratio is the result.  Forward alone and
forward + backward (on CPU the sparse backward is shardwise's block-sparse backward:
flex_attention has none on CPU) are timed as the median of ``--repeat`` runs.  At 4096 tokens the
sparse result is also compared with SDPA given the layout as a dense boolean mask.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings


def _median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(seq: int, args) -> dict:
    import torch
    import torch.nn.functional as F

    from shardwise.ops.sparse_attention import FixedSparsityConfig, SparseSelfAttention

    cfg = FixedSparsityConfig(num_heads=args.heads, block=args.block, num_local_blocks=args.local_blocks)
    attn = SparseSelfAttention(cfg, max_seq_length=seq, compile=True)
    density = attn.master_layout[0].float().mean().item()
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(1, args.heads, seq, args.head_dim, generator=g) for _ in range(4))

    def sparse_fwd():
        with torch.no_grad():
            attn(q, k, v)

    def dense_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def sparse_train():
        attn(*leaves).backward(grad)

    def dense_train():
        F.scaled_dot_product_attention(*leaves).backward(grad)

    t0 = time.perf_counter()
    sparse_fwd()  # compile
    sparse_train()
    compile_s = time.perf_counter() - t0
    dense_fwd()
    row = {"seq": seq, "heads": args.heads, "head_dim": args.head_dim, "block": args.block,
           "local_blocks": args.local_blocks, "density": round(density, 4), "first_call_s": round(compile_s, 1)}
    # sparse and dense alternate, so a change in machine load affects both medians alike
    for names, fns in ((("sparse_fwd_s", "dense_fwd_s"), (sparse_fwd, dense_fwd)),
                       (("sparse_fwd_bwd_s", "dense_fwd_bwd_s"), (sparse_train, dense_train))):
        times = {n: [] for n in names}
        for _ in range(args.repeat):
            for n, fn in zip(names, fns):
                times[n].append(_median_time(fn, 1))
        for n in names:
            row[n] = round(statistics.median(times[n]), 4)
    if seq <= 4096:  # the compiled kernels against SDPA with the layout as a dense boolean mask
        block_mask = attn.master_layout[0].bool().repeat_interleave(args.block, 0).repeat_interleave(args.block, 1)
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_mask)
            row["max_abs_diff_fwd"] = float((attn(q, k, v) - ref).abs().max())
        ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*ref_leaves, attn_mask=block_mask).backward(grad)
        for t in leaves:
            t.grad = None
        sparse_train()
        row["max_abs_diff_grad"] = max(float((a.grad - b.grad).abs().max()) for a, b in zip(leaves, ref_leaves))
    row["fwd_speedup"] = round(row["dense_fwd_s"] / row["sparse_fwd_s"], 2)
    row["fwd_bwd_speedup"] = round(row["dense_fwd_bwd_s"] / row["sparse_fwd_bwd_s"], 2)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--local-blocks", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    warnings.simplefilter("ignore")
    import torch

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = []
    for seq in args.seqs:
        row = run(seq, args)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| seq | density | sparse fwd s | dense fwd s | fwd speed-up | sparse fwd+bwd s | dense fwd+bwd s | "
          "fwd+bwd speed-up |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['seq']} | {r['density']:.3f} | {r['sparse_fwd_s']} | {r['dense_fwd_s']} | {r['fwd_speedup']}x | "
              f"{r['sparse_fwd_bwd_s']} | {r['dense_fwd_bwd_s']} | {r['fwd_bwd_speedup']}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
