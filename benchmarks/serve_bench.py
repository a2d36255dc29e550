"""The serving engine: paged, prefix-cached KV cache vs the left-padded one, in one process.

    python benchmarks/serve_bench.py [--clients 1 4 16 32] [--requests 3] [--hidden 256 --layers 8]
                                     [--history 1500] [--block_size 16] [--threads 1]

The model is a Llama-style model with random weights and a BPE tokenizer with a chat template,
built locally (``examples/chat/make_tiny_model.py``'s builders, a 4096-token context). The
engine (``shardwise.apps.batching.BatchedGenerator``, what ``shardwise serve`` runs) is driven
directly, without HTTP, so the numbers are the engine's own.

1. Throughput: for each number of concurrent clients, each client sends ``--requests`` requests
   back to back, of mixed lengths (0 to 12 turns of history, 16 to 64 new tokens, greedy). The
   padded and the paged engines (both ``--max_batch_size 32``) are measured alternately, twice
   each. Reported: generated tokens per second and time to first token p50 / p99, per layout.
2. Prefix caching: a conversation of about ``--history`` tokens is sent, then sent again with one
   more question (what a chat client does on the next turn). Time to first token of the second
   request, whose history is cached, vs the first (the same on the padded engine, which has no
   prefix cache). Several conversations; medians.
3. KV memory: during the 16-client run (or the largest below it), KV bytes held per active token,
   sampled every step, against the formula ``2 * layers * kv_heads * head_dim * dtype bytes``.

Output: Markdown tables. ``--threads`` sets torch's intra-op threads (1 by default, as in
``benchmarks/serve_batching.py``: on a shared machine more threads wait for busy cores).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples", "chat"))

TEXTS = ["您好，请问是张先生吗？", "是。", "什么事。", "打扰您了，给您介绍下近期的优惠活动？", "不需要。",
         "Hello, how can I help you?", "Where is my parcel?", "[姓名]:张三\n[省份]:湖北"] * 10
WORDS = ["parcel", "price", "order", "张三", "湖北", "help", "time", "offer", "需要", "活动"]


def build_model(out: str, hidden: int, layers: int) -> str:
    from make_tiny_model import build_model as build, build_tokenizer

    tokenizer = build_tokenizer(TEXTS, vocab_size=400, chat_template=True)
    model = build(tokenizer, hidden=hidden, layers=layers, heads=max(4, hidden // 64), context=4096, seed=0,
                  init_std=0.3)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def conversation(rng: random.Random, turns: int, question: str) -> list[dict]:
    messages = []
    for _ in range(turns):
        messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))})
        messages.append({"role": "assistant", "content": rng.choice(TEXTS)})
    return messages + [{"role": "user", "content": question}]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_clients(engine, chat, clients: int, requests: int, seed: int, sample_kv: list | None = None):
    """``clients`` threads each sending ``requests`` requests back to back; (tokens, wall s, ttfts)."""
    from shardwise.apps.generation import GenerationLimits

    rng = random.Random(seed)
    work = []
    for c in range(clients):
        jobs = []
        for r in range(requests):
            ids = chat.prompt_ids(conversation(rng, rng.randint(0, 12), f"{rng.choice(WORDS)} {c} {r}?"))
            jobs.append((ids, GenerationLimits(max_new_tokens=rng.randint(16, 64), temperature=0.0, top_p=1.0)))
        work.append(jobs)
    ttfts, tokens = [], []
    lock = threading.Lock()

    def client(jobs):
        for ids, limits in jobs:
            job = engine.submit(ids, limits)
            answer = job.result(600)
            with lock:
                ttfts.append(job.first_token_at - job.submitted)
                tokens.append(answer.completion_tokens)

    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            stats = engine.kv_cache_stats()
            if stats["active_tokens"]:
                sample_kv.append(stats["bytes_used"] / stats["active_tokens"])
            time.sleep(0.005)

    threads = [threading.Thread(target=client, args=(jobs,)) for jobs in work]
    watcher = threading.Thread(target=sampler) if sample_kv is not None else None
    start = time.perf_counter()
    if watcher:
        watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    stop.set()
    if watcher:
        watcher.join()
    return sum(tokens), wall, ttfts


def prefix_ttft(engine, chat, history_tokens: int, conversations: int, seed: int) -> tuple[list, list, int]:
    """Time to first token of a long conversation sent first (not cached) and again with one more turn."""
    from shardwise.apps.generation import GenerationLimits

    one = GenerationLimits(max_new_tokens=1, temperature=0.0, top_p=1.0)
    rng = random.Random(seed)
    cold, warm, length = [], [], 0
    for i in range(conversations):
        messages = []
        while len(chat.prompt_ids(messages + [{"role": "user", "content": "?"}])) < history_tokens:
            messages += conversation(rng, 1, "")[:-1]
        first = messages + [{"role": "user", "content": f"first question {i}"}]
        ids = chat.prompt_ids(first)
        job = engine.submit(ids, one)
        answer = job.result(600)
        cold.append(job.first_token_at - job.submitted)
        follow = first + [{"role": "assistant", "content": chat.tokenizer.decode(answer.token_ids,
                                                                                 skip_special_tokens=True)},
                          {"role": "user", "content": f"next question {i}"}]
        ids2 = chat.prompt_ids(follow)
        job = engine.submit(ids2, one)
        job.result(600)
        warm.append(job.first_token_at - job.submitted)
        length = len(ids2)
    return cold, warm, length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--history", type=int, default=1500, help="tokens of the cached conversation")
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--block_size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", nargs="+", default=["throughput", "prefix"], choices=["throughput", "prefix"])
    parser.add_argument("--model", default=None, help="a model folder to use instead of the built one")
    args = parser.parse_args()

    import torch

    from shardwise.apps.batching import BatchedGenerator
    from shardwise.apps.generation import ChatModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()[0]:.1f}; torch {torch.__version__}, {args.threads} thread(s)")
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or build_model(os.path.join(tmp, "model"), args.hidden, args.layers)
        chat = ChatModel.load(path)
        layouts = ("padded", "paged")
        engines = {k: BatchedGenerator(chat, max_batch_size=32, kv_cache=k, kv_block_size=args.block_size,
                                       kv_cache_bytes=None) for k in layouts}
        run_clients(engines["paged"], chat, 2, 1, seed=99)  # warm-up
        run_clients(engines["padded"], chat, 2, 1, seed=99)

        kv_clients = max([c for c in args.clients if c <= 16] or args.clients)
        kv_samples = {k: [] for k in layouts}
        if "throughput" in args.parts:
            throughput(args, engines, chat, layouts, kv_clients, kv_samples)
        if "prefix" in args.parts:
            prefix(args, engines, chat, layouts)
        formula = engines["paged"].kv_cache_stats()["bytes_per_token"]
        if any(kv_samples.values()):
            print(f"\nKV bytes per active token during the {kv_clients}-client run (formula: 2 x layers x kv_heads "
                  f"x head_dim x dtype bytes = {formula}; the paged cache rounds each sequence up to whole blocks "
                  f"of {args.block_size} tokens):\n")
            print("| layout | mean | max | mean / formula |")
            print("|---|---|---|---|")
            for k in layouts:
                s = kv_samples[k]
                if s:
                    print(f"| {k} | {statistics.mean(s):.0f} | {max(s):.0f} | {statistics.mean(s) / formula:.2f} |")
        for e in engines.values():
            e.close()
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


def throughput(args, engines, chat, layouts, kv_clients, kv_samples) -> None:
    print("\n| clients | padded tok/s | TTFT p50 / p99 s | paged tok/s | TTFT p50 / p99 s | paged/padded |")
    print("|---|---|---|---|---|---|")
    for clients in args.clients:
        results = {k: [0, 0.0, []] for k in layouts}
        for r in range(args.rounds):
            for k in layouts:
                sample = kv_samples[k] if clients == kv_clients else None
                tokens, wall, ttfts = run_clients(engines[k], chat, clients, args.requests, seed=clients * 100 + r,
                                                  sample_kv=sample)
                results[k][0] += tokens
                results[k][1] += wall
                results[k][2] += ttfts
        (a, a50, a99), (b, b50, b99) = [(t / w, pct(f, 0.5), pct(f, 0.99)) for t, w, f in
                                        (results[k] for k in layouts)]
        print(f"| {clients} | {a:.0f} | {a50:.3f} / {a99:.3f} | {b:.0f} | {b50:.3f} / {b99:.3f} | {b / a:.2f}x |",
              flush=True)


def prefix(args, engines, chat, layouts) -> None:
    print(f"\nTime to first token of a conversation of ~{args.history} tokens, sent again with one more turn "
          f"({args.conversations} conversations, medians):\n")
    print("| layout | prompt tokens | first send s | next turn s | first / next |")
    print("|---|---|---|---|---|")
    for k in layouts:
        cold, warm, length = prefix_ttft(engines[k], chat, args.history, args.conversations, seed=7)
        c, w = statistics.median(cold), statistics.median(warm)
        print(f"| {k} | {length} | {c:.3f} | {w:.3f} | {c / w:.1f}x |", flush=True)
    stats = engines["paged"].kv_cache_stats()
    print(f"\nprefix cache: {stats['prefix_hits']} of {stats['prefix_lookups']} prompt blocks found, "
          f"{stats['evictions']} evictions, {stats['blocks_total']} blocks of {stats['block_size']} tokens")


if __name__ == "__main__":
    main()
