"""Muon vs AdamW loss curves on the demo GPT (examples/gpt), one process; writes a PNG and prints a table.

    python benchmarks/muon_vs_adamw.py [--steps 300] [--out docs/muon_vs_adamw.png]
    python benchmarks/muon_vs_adamw.py --steps 5 --n_layer 1 --n_embd 32 --out /tmp/m.png   # a quick check

Both runs start from the same weights and see the same batches (random windows of the demo's
character corpus, seeded). AdamW is the demo's config (lr 3e-3, betas 0.9/0.95, weight decay 0.01,
warm-up 50 steps then cosine). Muon steps the hidden matrices (attention and MLP weights) with its
own lr (``--muon_lr``, default 0.02) under the same schedule, and its AdamW half steps the
embeddings, the head, norms and biases with the demo's AdamW settings. The embeddings and the head
are tagged ``use_muon = False`` by hand: the demo names them ``tok``/``pos``/``head``, which
DeepSpeed's name rule (``embed``, ``lm_head``) would not catch. Losses are smoothed over 10 steps
for the plot; the table gives the mean loss over the last 10% of the steps, and a held-out
validation loss at the end. Not a timing benchmark.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "gpt"))


def _config(opt: str, args) -> dict:
    adamw = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}
    if opt == "AdamW":
        optimizer = {"type": "AdamW", "params": adamw}
    else:
        optimizer = {"type": "Muon", "params": {"muon_lr": args.muon_lr, "momentum": 0.95, "adam_lr": adamw["lr"],
                                               "betas": adamw["betas"], "eps": adamw["eps"],
                                               "weight_decay": adamw["weight_decay"]}}
    return {"train_micro_batch_size_per_gpu": args.batch, "gradient_clipping": 1.0, "optimizer": optimizer,
            "scheduler": {"type": "WarmupCosineLR", "params": {
                "total_num_steps": args.steps, "warmup_num_steps": min(50, args.steps // 5),
                "warmup_type": "linear", "cos_min_ratio": 0.05}}}


def train(opt: str, args) -> tuple[list[float], float]:
    import shardwise
    from model import GPT, CharDataset, GPTConfig, lm_loss

    cfg = GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head)
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    for name, p in model.named_parameters():  # the demo's embeddings and head stay with AdamW
        p.use_muon = p.dim() >= 2 and not name.startswith(("tok.", "pos.", "head."))
    data = CharDataset(cfg.block_size)
    engine, *_ = shardwise.initialize(model=model, config=_config(opt, args))
    g = torch.Generator().manual_seed(args.seed)
    n_val = len(data) // 10  # the last 10% of the windows are held out
    losses = []
    for _ in range(args.steps):
        idx = torch.randint(0, len(data) - n_val, (args.batch,), generator=g).tolist()
        x, y = (torch.stack(t) for t in zip(*(data[i] for i in idx)))
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    engine.eval()
    with torch.no_grad():
        starts = range(len(data) - n_val, len(data), max(1, n_val // 256))
        vals = [lm_loss(engine(x[None]), y[None]).item() for x, y in (data[i] for i in starts)]
    return losses, sum(vals) / len(vals)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--n_layer", type=int, default=4)
    ap.add_argument("--n_embd", type=int, default=128)
    ap.add_argument("--n_head", type=int, default=4)
    ap.add_argument("--muon_lr", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "muon_vs_adamw.png"))
    args = ap.parse_args()
    curves = {opt: train(opt, args) for opt in ("AdamW", "Muon")}

    tail = max(1, args.steps // 10)
    print(f"demo GPT ({args.n_layer} layers, width {args.n_embd}), {args.steps} steps of {args.batch} windows")
    print(f"{'optimizer':10} {'train loss (last 10%)':>22} {'validation loss':>16}")
    for opt, (losses, val) in curves.items():
        print(f"{opt:10} {sum(losses[-tail:]) / tail:>22.4f} {val:>16.4f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for opt, (losses, _) in curves.items():
        smooth = [sum(losses[max(0, i - 9): i + 1]) / len(losses[max(0, i - 9): i + 1]) for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, label=opt)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title(f"demo GPT: Muon vs AdamW ({args.steps} steps, batch {args.batch})")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
