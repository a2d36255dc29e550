"""Pipeline parallelism on the demo GPT: step time against the predicted bubble, schedules compared,
peak activation memory per stage, pipeline vs data parallelism, and DeepSpeed 0.19.8 where it runs.

    python benchmarks/pipeline.py [--steps 4] [--layers 8] [--embd 128] [--rows 4] [--deepspeed-python PATH]

Each configuration is a fresh ``torchrun`` job (one intra-op thread per rank). A "step" is one
``train_batch`` of m micro-batches of ``rows`` sequences; the time is the median over ``--steps``
steps after one warm-up step. Peak activation memory is the most bytes of tensors autograd kept
for backward at once on a stage (weights excluded), measured with ``saved_tensors_hooks``.
DeepSpeed runs the same layers, seeds and config with ``DS_ACCELERATOR=cpu`` (its only schedule
is 1F1B); its first loss is printed next to ours (same initial weights: ``seed_layers``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT_DIR = os.path.join(ROOT, "examples", "gpt")


# ------------------------------------------------------------------------------------------ worker
def _layers(args, LayerSpec):
    sys.path.insert(0, GPT_DIR)
    import torch
    from model import Block, GPTConfig, lm_loss

    cfg = GPTConfig(vocab_size=128, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)

    class EmbedPipe(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            self.tok = torch.nn.Embedding(c.vocab_size, c.n_embd)
            self.pos = torch.nn.Embedding(c.block_size, c.n_embd)

        def forward(self, idx):
            return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))

    class HeadPipe(torch.nn.Module):
        def __init__(self, c):
            super().__init__()
            self.ln_f = torch.nn.LayerNorm(c.n_embd)
            self.head = torch.nn.Linear(c.n_embd, c.vocab_size, bias=False)

        def forward(self, x):
            return self.head(self.ln_f(x))

    specs = [LayerSpec(EmbedPipe, cfg)] + [LayerSpec(Block, cfg) for _ in range(args.layers)] + [LayerSpec(HeadPipe, cfg)]
    return specs, lm_loss, cfg


class _Meter:
    live = 0
    peak = 0
    skip: set = set()


class _Held:
    __slots__ = ("t", "n")

    def __init__(self, t):
        self.t = t
        self.n = 0 if t.untyped_storage().data_ptr() in _Meter.skip else t.numel() * t.element_size()
        _Meter.live += self.n
        _Meter.peak = max(_Meter.peak, _Meter.live)

    def __del__(self):
        _Meter.live -= self.n


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if args.backend == "deepspeed":
        import deepspeed as ds
        from deepspeed.pipe import LayerSpec, PipelineModule
    else:
        import shardwise as ds
        from shardwise.pipe import LayerSpec, PipelineModule
    ds.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    specs, loss_fn, cfg = _layers(args, LayerSpec)
    m, rows = args.micro, args.rows
    dp = world if args.mode == "dp" else world // args.stages
    config = {
        "train_batch_size": m * rows, "train_micro_batch_size_per_gpu": rows,
        "gradient_accumulation_steps": m // dp,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "gradient_clipping": 1.0, "steps_per_print": 10**6,
    }
    if args.mode == "dp":
        from shardwise.pipe.module import build_sequential

        model = build_sequential(specs, seed_layers=True)
    else:
        extra = {} if args.backend == "deepspeed" else {"schedule": args.schedule, "virtual_stages": args.chunks}
        model = PipelineModule(specs, num_stages=args.stages, loss_fn=loss_fn, seed_layers=True,
                               partition_method="uniform", **extra)
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    _Meter.skip = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    rank = dist.get_rank()
    times, losses = [], []
    for step in range(args.steps + 1):
        g = torch.Generator().manual_seed(step)
        data = torch.randint(0, cfg.vocab_size, (m, rows, args.seq + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(_Held, lambda h: h.t):
            if args.mode == "dp":
                total = 0.0
                mine = data[rank * (m // dp):(rank + 1) * (m // dp)]
                for mb in mine:
                    loss = loss_fn(engine(mb[:, :-1]), mb[:, 1:])
                    engine.backward(loss)
                    engine.step()
                    total += float(loss)
                t = torch.tensor([total / len(mine) / dp])
                dist.all_reduce(t)
                loss = float(t)
            else:
                it = iter([(mb[:, :-1], mb[:, 1:]) for mb in data])
                loss = float(engine.train_batch(data_iter=it))
        dt = time.perf_counter() - t0
        if step:
            times.append(dt)
        losses.append(loss)
    peaks = [None] * world
    dist.all_gather_object(peaks, _Meter.peak)
    if rank == 0:
        stages = args.stages if args.mode != "dp" else 1
        per_stage = [max(peaks[s * dp:(s + 1) * dp]) for s in range(stages)]
        print("RESULT " + json.dumps({"time": statistics.median(times), "losses": losses,
                                      "peak_mib": [round(p / 2**20, 2) for p in per_stage]}), flush=True)


# ------------------------------------------------------------------------------------ orchestrator
def run(args, *, backend, mode, stages, micro, schedule="1f1b", virtual=1, world=None) -> dict | None:
    world = world or stages
    py = args.deepspeed_python if backend == "deepspeed" else sys.executable
    cmd = [py, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(args.port),
           __file__, "--worker", "--backend", backend, "--mode", mode, "--stages", str(stages), "--micro", str(micro),
           "--schedule", schedule, "--chunks", str(virtual), "--steps", str(args.steps), "--layers",
           str(args.layers), "--embd", str(args.embd), "--rows", str(args.rows), "--seq", str(args.seq)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if backend == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = ROOT
    args.port += 1
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    line = next((l for l in proc.stdout.splitlines() if "RESULT " in l), None)
    if line is None:
        err = (proc.stderr.strip().splitlines() or ["?"])[-1]
        print(f"  {backend} {mode} p={stages} m={micro} {schedule}: failed ({err[:200]})", file=sys.stderr)
        return None
    return json.loads(line.split("RESULT ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--backend", default="shardwise")
    ap.add_argument("--mode", default="pipe")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--deepspeed-python", default="/work/dsvenv/bin/python")
    ap.add_argument("--micro-list", default="2,4,8")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from shardwise.pipe.schedule import bubble_fraction

    rows = []
    for p in (2, 4):
        for m in [int(x) for x in args.micro_list.split(",") if int(x) >= p]:
            for sched, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2)):
                r = run(args, backend="shardwise", mode="pipe", stages=p, micro=m, schedule=sched, virtual=v)
                rows.append(("shardwise", p, m, sched, v, r))
            if os.path.exists(args.deepspeed_python):
                rows.append(("deepspeed", p, m, "1f1b", 1, run(args, backend="deepspeed", mode="pipe", stages=p,
                                                                 micro=m)))
            if m % p == 0:
                rows.append(("shardwise", p, m, "data parallel", 1,
                             run(args, backend="shardwise", mode="dp", stages=p, micro=m, world=p)))
    print("| p | m | run | bubble (p-1)/(v·m+p-1) | step time (s) | vs 1F1B | peak activations per stage (MiB) | first loss |")
    print("|---|---|---|---|---|---|---|---|")
    base = {}
    for backend, p, m, sched, v, r in rows:
        if r and backend == "shardwise" and sched == "1f1b":
            base[(p, m)] = r["time"]
    for backend, p, m, sched, v, r in rows:
        name = f"{backend} {sched}" + (f" v={v}" if v > 1 else "")
        bubble = "—" if sched == "data parallel" else f"{bubble_fraction(p, m, v):.2f}"
        if r is None:
            print(f"| {p} | {m} | {name} | {bubble} | failed | | | |")
            continue
        rel = r["time"] / base[(p, m)] if (p, m) in base else float("nan")
        print(f"| {p} | {m} | {name} | {bubble} | {r['time']:.3f} | {rel:.2f} | "
              f"{' / '.join(f'{x:.1f}' for x in r['peak_mib'])} | {r['losses'][0]:.5f} |")


if __name__ == "__main__":
    main()
