"""The walk of one ZeRO-2 gradient and of one pipeline micro-batch through shardwise's files, measured:
which files the calls cross, how many crossings, and which pairs of files call each other both ways.

    python benchmarks/engine_walk.py [--what zero2|pipe] [--tree DIR]

Two CPU ranks over gloo (``torchrun``), the reference GPT (shardwise.models.gpt). ZeRO-2: data 2, one
``engine.backward(loss)`` and ``engine.step()`` at the accumulation boundary, traced on rank 0 (the forward
is not traced). Pipeline: 2 stages, ZeRO-1, one ``train_batch`` of one micro-batch, traced on both stages
(the files are the union), and the Python calls (``cProfile``) of a further ``train_batch`` per stage.
``sys.setprofile`` sees every Python call; a crossing is a call whose nearest
shardwise caller frame is in another shardwise file. "Gradient path" leaves out the bookkeeping files
(timers, monitors, logging, config reads, the accelerator shim, the grid's rank arithmetic, the engine's
liveness checks) that a step also calls, and the model's own code (the reference GPT's layers and loss,
whose backward autograd runs, and ``PipelineModule``'s ``forward``, which runs a stage's layers).

The files of the gradient path are counted two ways: every shardwise file on it, and the engine / ZeRO /
pipeline files (``runtime/``, ``zero/``, ``pipe/``) with the layers below them counted apart: the comm
layer (``comm/``, which plays torch.distributed's role) and the leaf helpers outside those packages
(``precision.py``'s gradient kernels, ...), which are called and call nothing back.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOKKEEPING = ("runtime/timers.py", "monitor/", "runtime/progress.py", "training_state.py", "config/",
               "utils/logging.py", "accelerator/", "runtime/engine_compat.py", "runtime/data_efficiency.py",
               "topology.py", "rank_layout.py", "parallel_dims.py", "runtime/lifecycle.py", "models/",
               "tensor_parallel/", "sequence/", "pipe/module.py")
# pipe/module.py is the model of a pipeline run: ``PipelineModule`` is the ``nn.Module`` the user builds, and the
# gradient path calls only its ``forward`` (the stage's layers), as it calls the reference GPT's in a ZeRO-2 run.


class _Walk:
    def __init__(self, package: str) -> None:
        self.package = package + os.sep
        self.files: set[str] = set()
        self.crossings: list[tuple[str, str]] = []
        self.model_entries: set[str] = set()  # the functions of pipe/module.py the engine calls

    def _rel(self, frame):
        f = frame.f_code.co_filename
        return f[len(self.package):] if f.startswith(self.package) else None

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        callee = self._rel(frame)
        if callee is None:
            return
        self.files.add(callee)
        up = frame.f_back
        while up is not None and self._rel(up) is None:
            up = up.f_back
        caller = self._rel(up) if up is not None else None
        if caller is not None and caller != callee:
            self.crossings.append((caller, callee))
            if callee == "pipe/module.py":
                self.model_entries.add(frame.f_code.co_name)


ENGINE_LAYERS = ("runtime/", "zero/", "pipe/")  # the engine, ZeRO and pipeline files
COMM_LAYER = ("comm/",)  # below them, in torch.distributed's role


def layer_of(f: str) -> str:
    """``"engine/ZeRO/pipe"``, ``"comm"`` or ``"helpers"`` (a file outside both, e.g. ``precision.py``)."""
    if f.startswith(ENGINE_LAYERS):
        return "engine/ZeRO/pipe"
    return "comm" if f.startswith(COMM_LAYER) else "helpers"


def _summary(walk: _Walk) -> dict:
    def path(f):
        return not any(f.startswith(b) for b in BOOKKEEPING)

    out = {}
    for name, keep in (("all", lambda f: True), ("gradient path", path)):
        files = sorted(f for f in walk.files if keep(f))
        cross = [(a, b) for a, b in walk.crossings if keep(a) and keep(b)]
        pairs = {(a, b) for a, b in cross}
        both = sorted({tuple(sorted(p)) for p in pairs if (p[1], p[0]) in pairs})
        counts = {f"{a} -> {b}": cross.count((a, b)) for a, b in sorted(pairs)}
        layers = {k: [f for f in files if layer_of(f) == k] for k in ("engine/ZeRO/pipe", "helpers", "comm")}
        out[name] = {"files": files, "layers": layers, "crossings": len(cross), "distinct crossings": len(pairs),
                     "both ways": [f"{a} <-> {b}" for a, b in both], "pairs": counts}
    return out


def worker(args) -> None:
    import torch

    import shardwise
    from shardwise.models.gpt import GPT, GPTConfig, gpt_pipeline_module

    torch.set_num_threads(1)
    shardwise.init_distributed()
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(vocab_size=64, seq_len=16, hidden=32, n_layers=2, n_heads=2)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 17), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    walk = _Walk(os.path.dirname(shardwise.__file__))
    if args.what == "zero2":
        ds = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}}
        engine = shardwise.initialize(model=GPT(cfg), config=ds)[0]
        for step in range(2):  # the second step is traced (buffers and hooks exist by then)
            loss = engine(x[rank:rank + 1], y[rank:rank + 1])
            if step and rank == 0:
                sys.setprofile(walk)
            engine.backward(loss)
            engine.step()
            sys.setprofile(None)
    else:
        ds = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}}
        model = gpt_pipeline_module(cfg, num_stages=2, partition_method="uniform")
        engine = shardwise.initialize(model=model, config=ds)[0]
        engine.train_batch(iter([(x, y)]))
        sys.setprofile(walk)
        engine.train_batch(iter([(x, y)]))
        sys.setprofile(None)
        profile = cProfile.Profile()  # the Python calls of the same train_batch, untraced otherwise
        profile.runcall(engine.train_batch, iter([(x, y)]))
        calls = pstats.Stats(profile).total_calls
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(rows, {"files": sorted(walk.files), "crossings": walk.crossings,
                                               "entries": sorted(walk.model_entries),
                                               "calls": locals().get("calls")})
    if rank == 0:
        merged = _Walk("")
        for r in rows:
            merged.files |= set(r["files"])
            merged.crossings += [tuple(c) for c in r["crossings"]]
            merged.model_entries |= set(r["entries"])
        summary = _summary(merged)
        if merged.model_entries:  # counted with the model only while the engine calls nothing there but forward
            summary["gradient path"]["model calls"] = sorted(merged.model_entries)
        if rows[0]["calls"] is not None:
            summary["all"]["python calls per rank"] = [r["calls"] for r in rows]
        print("RESULT " + json.dumps(summary), flush=True)



def run_two_ranks(script: str, tree: str, *extra: str, label: str = "worker") -> str:
    """Run ``script --worker *extra`` as a two-rank ``torchrun`` job with ``tree`` first on ``PYTHONPATH``;
    the text after ``RESULT `` on its output (exits naming ``label`` with the job's output if there is none)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.abspath(script), "--worker", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.path.abspath(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{label} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return line[len("RESULT "):]

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--what", default=None, choices=["zero2", "pipe"], help="one walk (default: both)")
    p.add_argument("--tree", default=ROOT)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    walks = (("zero2", "one ZeRO-2 gradient (backward + step)"), ("pipe", "one pipeline micro-batch"))
    for what, title in [w for w in walks if args.what in (None, w[0])]:
        result = json.loads(run_two_ranks(__file__, args.tree, "--what", what, label=what))
        print(f"## {title}")
        for name, r in result.items():
            layers = r["layers"]
            print(f"{name}: {len(r['files'])} shardwise files; {len(layers['engine/ZeRO/pipe'])} engine/ZeRO/pipe "
                  f"files, besides {len(layers['helpers'])} helpers and {len(layers['comm'])} of the comm layer; "
                  f"{r['crossings']} crossings ({r['distinct crossings']} distinct), "
                  f"{len(r['both ways'])} pairs both ways")
            for layer, files in layers.items():
                if files:
                    print(f"  {layer}: " + ", ".join(files))
            if "python calls per rank" in r:
                print("  Python calls of one train_batch (cProfile), per stage: " + str(r["python calls per rank"]))
            if r["both ways"]:
                print("  both ways: " + "; ".join(r["both ways"]))
            if name == "gradient path":
                print("  crossings: " + "; ".join(f"{k} x{v}" for k, v in r["pairs"].items()))
            if "model calls" in r:
                print("  calls into pipe/module.py (the model, not counted): " + ", ".join(r["model calls"]))
                if set(r["model calls"]) - {"forward"}:
                    print("  NOTE: pipe/module.py is called for more than its forward; count it as an engine file")


if __name__ == "__main__":
    main()
