"""`shardwise serve` under load: batched decoding vs one request at a time.

    python benchmarks/serve_batching.py [--clients 1 4 16] [--requests 4] [--max_tokens 32]
                                        [--hidden 128 --layers 4]

Two servers run the same locally built Llama-style model (random weights, a BPE tokenizer with
a chat template): one with ``--max_batch_size 16`` (batched) and one with ``--max_batch_size 1``
(one at a time). For each number of concurrent clients, each client sends ``--requests``
OpenAI-format requests back to back (``max_tokens`` fixed, greedy decoding, distinct prompts);
the two servers are measured alternately (batched, single, batched, single), so load from other
work on the machine touches both. Reported: generated tokens per second over the whole run, and
the p50 / p99 of the request latency (send to last byte). Output: a Markdown table.

With ``--before DIR`` (a checkout of an older commit, e.g. ``git worktree add --detach DIR
b6158b7``) the two servers are instead that checkout's ``shardwise serve`` and this one's, both
with ``--max_batch_size 16``, measured alternately in the same way; the table gives after/before
ratios. The load average before and after the run is printed: on a shared machine, note it.

Each server gets ``OMP_NUM_THREADS=1`` unless the variable is set: on a small shared machine,
torch's default of one thread per core made every decoding step wait for busy cores (ten times
slower in our runs), which hides what batching does.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "chat"))

from make_tiny_model import make_tiny_model  # noqa: E402

TEXTS = ["您好，请问是张先生吗？", "是。", "什么事。", "打扰您了，给您介绍下近期的优惠活动？", "不需要。",
         "Hello, how can I help you?", "Where is my parcel?", "[姓名]:张三\n[省份]:湖北"] * 10
WORDS = ["parcel", "price", "order", "张三", "湖北", "help", "time", "offer", "需要", "活动"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, batch: int, max_tokens: int, source: str = ROOT) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", "serve", "--model", model, "--port", str(port),
                             "--max_batch_size", str(batch), "--max_queue", "256", "--max_new_tokens",
                             str(max_tokens), "--log_level", "warning"],
                            env={**os.environ, "PYTHONPATH": source,
                                 "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
                            stdout=subprocess.DEVNULL, cwd=source)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


async def load(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    latencies: list[float] = []
    tokens = 0

    async def client(c: int, http: httpx.AsyncClient) -> None:
        nonlocal tokens
        for r in range(requests):
            prompt = f"{WORDS[(c + r) % len(WORDS)]} {WORDS[(3 * c + r) % len(WORDS)]} {c}-{r}?"
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
            started = time.perf_counter()
            resp = await http.post(url + "/v1/chat/completions", json=body)
            latencies.append(time.perf_counter() - started)
            resp.raise_for_status()
            tokens += resp.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(c, http) for c in range(clients)))
        wall = time.perf_counter() - started
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(round(0.99 * (len(latencies) - 1))))]
    return {"tokens_per_s": tokens / wall, "p50": statistics.median(latencies), "p99": p99, "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=3, help="requests per client per round")
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2, help="alternating measurements per server (default 2)")
    parser.add_argument("--before", metavar="DIR", help="compare with the server of this checkout (see above)")
    args = parser.parse_args()
    print(f"load average at start: {os.getloadavg()}", file=sys.stderr, flush=True)

    tmp = tempfile.mkdtemp(prefix="serve-bench-")
    model = make_tiny_model(os.path.join(tmp, "model"), TEXTS, chat_template=True, hidden=args.hidden,
                            layers=args.layers, vocab_size=400, init_std=0.3, seed=3)
    if args.before:
        servers = {"before": start_server(model, 16, args.max_tokens, os.path.abspath(args.before)),
                   "after": start_server(model, 16, args.max_tokens)}
    else:
        servers = {"batched (--max_batch_size 16)": start_server(model, 16, args.max_tokens),
                   "one at a time (--max_batch_size 1)": start_server(model, 1, args.max_tokens)}
    try:
        for _, url in servers.values():  # warm-up
            asyncio.run(load(url, 2, 1, args.max_tokens))
        rows = []
        for clients in args.clients:
            runs: dict[str, list[dict]] = {name: [] for name in servers}
            for _ in range(args.rounds):  # alternate, so both see the same background load
                for name, (_, url) in servers.items():
                    runs[name].append(asyncio.run(load(url, clients, args.requests, args.max_tokens)))
            result = {}
            for name, rs in runs.items():
                result[name] = {"tokens_per_s": statistics.mean(r["tokens_per_s"] for r in rs),
                                "p50": statistics.mean(r["p50"] for r in rs),
                                "p99": max(r["p99"] for r in rs)}
            rows.append((clients, result))
            print(f"{clients} clients: " + "; ".join(f"{n}: {r['tokens_per_s']:.0f} tok/s" for n, r in result.items()),
                  file=sys.stderr, flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait()
    print(f"load average at end: {os.getloadavg()}", file=sys.stderr, flush=True)
    names = list(servers)
    if args.before:
        print("| clients | before tok/s | p50 / p99 s | after tok/s | p50 / p99 s | tok/s after/before | "
              "p50 after/before |")
        print("|---|---|---|---|---|---|---|")
        for clients, result in rows:
            b, a = result["before"], result["after"]
            print(f"| {clients} | {b['tokens_per_s']:.0f} | {b['p50']:.2f} / {b['p99']:.2f} | {a['tokens_per_s']:.0f} | "
                  f"{a['p50']:.2f} / {a['p99']:.2f} | {a['tokens_per_s'] / b['tokens_per_s']:.2f}x | "
                  f"{a['p50'] / b['p50']:.2f}x |")
        return
    print(f"| clients | {names[0]} tok/s | p50 / p99 s | {names[1]} tok/s | p50 / p99 s | speed-up |")
    print("|---|---|---|---|---|---|")
    for clients, result in rows:
        b, s = result[names[0]], result[names[1]]
        print(f"| {clients} | {b['tokens_per_s']:.0f} | {b['p50']:.2f} / {b['p99']:.2f} | {s['tokens_per_s']:.0f} | "
              f"{s['p50']:.2f} / {s['p99']:.2f} | {b['tokens_per_s'] / s['tokens_per_s']:.1f}x |")


if __name__ == "__main__":
    main()
