"""Chat fine-tuning quality: train on the synthetic customer-service set, serve, score held-out dialogues.

    python benchmarks/chat_quality.py --workdir /tmp/chat-bench            # the documented budget
    python benchmarks/chat_quality.py --workdir /tmp/chat-bench --steps 100 --stage 3

Steps: generate the synthetic data (examples/chat/make_synthetic_data.py; dev personas never
occur in train), build a small Llama and a BPE tokenizer locally (examples/chat/make_tiny_model.py),
fine-tune with `shardwise run --num_procs 2 -m shardwise.apps.finetune`, start `shardwise serve`
on the output folder, send every dev record (prompt + history) to POST / and compare the answer
with the reference response. Prints and writes ``<workdir>/quality.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "chat"))
sys.path.insert(0, ROOT)

from make_synthetic_data import make  # noqa: E402
from make_tiny_model import make_tiny_model, texts_from_files  # noqa: E402

from shardwise.apps.metrics import score  # noqa: E402


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finetune(args, train: str, dev: str, model: str, out: str) -> float:
    cfg = json.load(open(os.path.join(ROOT, "examples", "chat", "ds_config.json")))
    cfg["zero_optimization"]["stage"] = args.stage
    cfg_path = os.path.join(args.workdir, "ds_config.json")
    json.dump(cfg, open(cfg_path, "w"))
    cmd = [sys.executable, "-m", "shardwise", "run", "--num_procs", str(args.procs), "-m", "shardwise.apps.finetune",
           "--deepspeed", cfg_path, "--train_file", train, "--validation_file", dev, "--history_column", "history",
           "--model_name_or_path", model, "--output_dir", out, "--max_source_length", "192",
           "--max_target_length", "48", "--per_device_train_batch_size", str(args.micro_batch),
           "--max_steps", str(args.steps), "--logging_steps", "50", "--save_steps", "0",
           "--learning_rate", str(args.lr), "--warmup_steps", "30", "--seed", str(args.seed),
           "--data_cache_dir", os.path.join(args.workdir, "cache")]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def ask_all(out: str, dev: str) -> tuple[list[str], list[str]]:
    port = free_port()
    log = open(os.path.join(os.path.dirname(out), "serve.log"), "w")
    server = subprocess.Popen([sys.executable, "-m", "shardwise", "serve", "--model", out, "--port", str(port),
                               "--max_new_tokens", "64"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):
            if server.poll() is not None:
                raise SystemExit(f"server exited with {server.returncode}; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        else:
            raise SystemExit("server did not start within 2 minutes")
        answers, references = [], []
        with open(dev, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                r = httpx.post(url, json={"prompt": rec["prompt"], "history": rec["history"]}, timeout=120)
                r.raise_for_status()
                answers.append(r.json()["response"])
                references.append(rec["response"])
        return answers, references
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=1200, help="optimizer steps (the documented budget)")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, help="ZeRO stage")
    parser.add_argument("--micro_batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    train, dev = make(os.path.join(args.workdir, "data"), dialogues=600, dev_dialogues=40, seed=args.seed)
    model = make_tiny_model(os.path.join(args.workdir, "model"), texts_from_files([train]), hidden=args.hidden,
                            layers=args.layers, heads=4, vocab_size=1200, seed=args.seed)
    out = os.path.join(args.workdir, "out")
    seconds = finetune(args, train, dev, model, out)
    answers, references = ask_all(out, dev)
    result = {**score(answers, references), "steps": args.steps, "procs": args.procs, "zero_stage": args.stage,
              "global_batch": args.micro_batch * args.procs, "train_seconds": round(seconds, 1),
              "examples": [{"reference": r, "answer": a} for a, r in list(zip(answers, references))[:5]]}
    with open(os.path.join(args.workdir, "quality.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, ensure_ascii=False, indent=1)
    print(json.dumps(result, ensure_ascii=False, indent=1))


if __name__ == "__main__":
    main()
