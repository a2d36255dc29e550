"""Longest sequence a small Llama trains on within a fixed memory cap per rank: one process on whole
sequences ("plain") vs Ulysses sequence parallelism over 2 processes (each holding half of every
sequence), optionally with tiled MLP and tiled logits+loss when ``shardwise.runtime.sequence_parallel.tiled``
is present.

    sudo python benchmarks/long_sequence.py [--cap-mb 1024] [--lengths 1024,2048,...] [--steps 3]

Every rank runs in its own memory cgroup (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``) capped
at ``--cap-mb`` (what one accelerator's memory would be); there is no swap, so a rank that needs more
is killed. For each mode the script tries the lengths in increasing order, one job per length, and
stops at the first that fails. It prints, per mode and length: ok / killed, the median step time
(after the first step) and every rank's peak RSS. The model: Llama, 4 layers, hidden 256, 8 query
and 4 key/value heads, MLP 688, vocabulary 32000, fp32, sdpa attention, ZeRO-1, Adam.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _cap_memory(limit: int, tag: str) -> None:
    """Move this process into a new memory cgroup limited to ``limit`` bytes."""
    name = f"shardwise-longseq-{tag}-{os.getpid()}"
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1):
        path = os.path.join(v1, name)
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "memory.limit_in_bytes"), "w").write(str(limit))
    else:
        path = os.path.join("/sys/fs/cgroup", name)
        os.makedirs(path, exist_ok=True)
        open(os.path.join(path, "memory.max"), "w").write(str(limit))
    open(os.path.join(path, "cgroup.procs"), "w").write(str(os.getpid()))


def _model_dir(tmp: str) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(tmp, "llama")
    if not os.path.exists(path):
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1 << 17)
        LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _tiled_available() -> bool:
    try:
        import shardwise.runtime.sequence_parallel.tiled  # noqa: F401
    except ImportError:
        return False
    return True


def _patch_tiling(model, shards_of) -> None:
    """Tiled MLP in every layer, as DeepSpeed's ALST tutorial patches LlamaMLP.forward."""
    from shardwise.runtime.sequence_parallel.ulysses_sp import TiledMLP

    for layer in model.model.layers:
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            def fn(self, h):
                return self.down_proj(self.act_fn(self.gate_proj(h)) * self.up_proj(h))
            return TiledMLP.apply(fn, mlp, x, shards_of(x), [mlp.down_proj.weight, mlp.gate_proj.weight,
                                                               mlp.up_proj.weight])

        mlp.forward = forward


def _tiled_loss(model, hidden, shift_labels, shards: int):
    """Loss without materialising the whole logits: DeepSpeed's sequence_tiled_compute pattern."""
    import torch
    from shardwise.runtime.sequence_parallel.ulysses_sp import sequence_tiled_compute

    def loss_fn(self, hidden_states, shift_labels):
        logits = self.lm_head(hidden_states).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), shift_labels.view(-1),
                                                 ignore_index=-100, reduction="sum")

    total = sequence_tiled_compute(loss_fn, shift_labels.shape[1], shards,
                                   dict(hidden_states=hidden, shift_labels=shift_labels), dict(self=model),
                                   "hidden_states", [model.lm_head.weight], output_unshard_dimension=0,
                                   output_reduction="sum")
    return total / max(int((shift_labels != -100).sum()), 1)


def _rank(rank: int, world: int, port: int, length: int, steps: int, cap: int, path: str, tiled: bool, out: str):
    _cap_memory(cap, f"r{rank}")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    torch.set_num_threads(1)
    import shardwise
    from shardwise.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from transformers import AutoModelForCausalLM

    shardwise.init_distributed("gloo")
    sp = world
    mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=path, core_attn_implementation="sdpa",
                                                          sequence_parallel_size=sp, micro_batch_size=1)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").train()
    model.config.use_cache = False
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": 1}, "sequence_parallel_size": sp}
    engine, *_ = shardwise.initialize(model=model, config=config, mpu=mpu)
    if tiled:
        _patch_tiling(engine.module, lambda x: max(1, x.shape[1] // 256))
    g = torch.Generator().manual_seed(rank)
    samples = [{"input_ids": (ids := torch.randint(0, 32000, (1, length), generator=g)),
                "position_ids": torch.arange(length)[None], "labels": ids.clone()} for _ in range(steps)]
    if sp > 1:
        loader = UlyssesSPDataLoaderAdapter(samples, sp_rank=mpu.get_sequence_parallel_rank(),
                                            sp_group=mpu.get_sequence_parallel_group(), sp_world_size=sp,
                                            device=engine.device)
    else:
        loader = [dict(s, shift_labels=torch.cat([s["labels"][:, 1:], torch.tensor([[-100]])], 1)) for s in samples]
        for s in loader:
            s.pop("labels")
    times = []
    for step, batch in zip(range(steps), loader):
        t0 = time.perf_counter()
        shift_labels = batch.pop("shift_labels")
        if tiled:
            hidden = engine.module.model(**batch).last_hidden_state
            loss = _tiled_loss(engine.module, hidden, shift_labels, max(1, shift_labels.shape[1] // 256))
        else:
            logits = engine(**batch).logits
            loss = engine.module.loss_function(logits=logits, labels=None, shift_labels=shift_labels,
                                               vocab_size=32000)
            del logits
        if sp > 1:
            good = (shift_labels != -100).sum()
            total = torch.distributed.nn.functional.all_reduce(loss * good, group=mpu.get_sequence_parallel_group())
            loss = total / torch.distributed.nn.functional.all_reduce(good, group=mpu.get_sequence_parallel_group())
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"times": times, "rss": rss}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(world: int, length: int, args, path: str, tiled: bool) -> dict | None:
    with tempfile.TemporaryDirectory() as out:
        port = _free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--_rank", json.dumps(
            [r, world, port, length, args.steps, args.cap_mb << 20, path, tiled, out])],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(out, f"rank{r}.err"), "w")) for r in range(world)]
        deadline = time.time() + args.timeout
        failed: list = []
        while time.time() < deadline and any(p.poll() is None for p in procs):
            failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
            if failed:
                break  # a rank died (killed at the cap): its peers would wait in a collective
            time.sleep(0.5)
        failed = failed or [p.returncode for p in procs if p.poll() not in (None, 0)]
        timed_out = any(p.poll() is None for p in procs) and not failed
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        if failed or timed_out:
            if timed_out:
                return {"ok": False, "why": f"timed out after {args.timeout:.0f} s"}
            if -9 in failed:
                return {"ok": False, "why": "killed (over the cap)"}
            errs = [open(os.path.join(out, f"rank{r}.err")).read()[-400:] for r in range(world)]
            return {"ok": False, "why": f"exit {failed}: {errs}"}
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    return {"ok": True, "step": statistics.median(ranks[0]["times"][1:]), "rss": [r["rss"] for r in ranks]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap-mb", type=int, default=1024, help="memory cap per rank (MiB)")
    ap.add_argument("--lengths", default="1024,2048,3072,4096,6144,8192,12288,16384")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--_rank", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._rank:
        _rank(*json.loads(args._rank))
        return
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = [("plain", 1, False), ("sequence parallel 2", 2, False)]
    if _tiled_available():
        modes.append(("sequence parallel 2 + tiling", 2, True))
    with tempfile.TemporaryDirectory() as tmp:
        path = _model_dir(tmp)
        print(f"cap {args.cap_mb} MiB per rank, {args.steps} steps per job")
        for name, world, tiled in modes:
            longest = None
            for length in lengths:
                r = _job(world, length, args, path, tiled)
                if not r["ok"]:
                    print(f"{name:32s} seq {length:6d}: {r['why']}", flush=True)
                    break
                longest = length
                rss = ", ".join(f"{x / 2**20:.0f}" for x in r["rss"])
                print(f"{name:32s} seq {length:6d}: ok, step {r['step']:.2f} s, peak RSS per rank {rss} MiB",
                      flush=True)
            print(f"{name:32s} longest trained: {longest}", flush=True)


if __name__ == "__main__":
    main()
