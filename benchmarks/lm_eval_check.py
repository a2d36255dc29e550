"""lm-evaluation-harness against ``shardwise serve``: its ``local-completions`` model (the OpenAI
completions API with ``echo`` and ``logprobs``) must give the same log-likelihoods as its ``hf``
model running the same weights in-process.

    pip install lm-eval            # an optional tool; pulls in datasets, pandas, ...
    python benchmarks/lm_eval_check.py                         # a tiny local model, built here
    python benchmarks/lm_eval_check.py --model out --adapter sql=out/sql-lora [--adapter ...]

The task is a small log-likelihood task written here from local data (no download): each
document's continuation is scored given its context. The script starts ``shardwise serve`` (with
the adapters under ``--lora_modules``), runs both lm-eval models with ``add_bos_token=True`` and
prints each document's two log-likelihoods; it exits 1 when any pair differs by more than
``--tolerance``. Each ``--adapter NAME=DIR`` is scored too: the server picks it by the request's
``model`` field, the ``hf`` model loads it with ``peft=DIR``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK = "shardwise_tiny_loglikelihood"
DOCS = [("您好，请问是张先生吗？", "是。"), ("Hello, how can I help you?", " Where is my parcel?"),
        ("打扰您了，给您介绍下近期的优惠活动？", "不需要。"), ("[姓名]:张三\n[省份]:", "湖北"),
        ("Where is my", " parcel?"), ("什么", "事。")]


def write_task(folder: str) -> str:
    """A log-likelihood task over local JSON lines; returns the folder to include."""
    data = os.path.join(folder, "docs.jsonl")
    with open(data, "w", encoding="utf-8") as f:
        for context, continuation in DOCS:
            f.write(json.dumps({"context": context, "continuation": continuation}, ensure_ascii=False) + "\n")
    with open(os.path.join(folder, f"{TASK}.yaml"), "w") as f:
        f.write(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(data)}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return folder


def tiny_model(folder: str) -> str:
    sys.path.insert(0, os.path.join(ROOT, "examples", "chat"))
    from make_tiny_model import make_tiny_model

    texts = [t for pair in DOCS for t in pair] * 10
    return make_tiny_model(os.path.join(folder, "model"), texts, chat_template=True, vocab_size=400, init_std=0.3,
                           seed=3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(model: str, adapters: list[str], log_path: str, timeout: float = 180.0):
    import httpx

    port = _free_port()
    extra = ["--lora_modules", *adapters] if adapters else []
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "shardwise", "serve", "--model", model, "--port", str(port),
                                 "--served_model_name", "base", "--log_level", "warning", *extra],
                                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"shardwise serve exited with {proc.returncode}:\n{open(log_path).read()}")
                with contextlib.suppress(httpx.TransportError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shardwise serve not up after {timeout} s:\n{open(log_path).read()}")
                time.sleep(0.25)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def loglikelihoods(results: dict) -> list[float]:
    samples = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [float(s["resps"][0][0][0]) for s in samples]


def compare(model: str, adapters: dict[str, str], workdir: str) -> dict[str, tuple[list[float], list[float]]]:
    """For the base model (as "base") and each adapter: ``(hf, served)`` log-likelihoods of every
    document. One server serves them all."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=write_task(workdir))
    common = dict(tasks=[TASK], task_manager=tasks, log_samples=True, batch_size=2, verbosity="WARNING")
    out = {}
    with serving(model, [f"{n}={d}" for n, d in adapters.items()], os.path.join(workdir, "serve.log")) as url:
        for name, folder in [("base", None), *adapters.items()]:
            hf_args = f"pretrained={model},dtype=float32,device=cpu,add_bos_token=True"
            hf = simple_evaluate(model="hf", model_args=hf_args + (f",peft={folder}" if folder else ""), **common)
            served = simple_evaluate(
                model="local-completions", **common,
                model_args=f"base_url={url}/v1/completions,model={name},tokenizer={model},"
                           "tokenizer_backend=huggingface,tokenized_requests=True,add_bos_token=True,max_retries=1")
            out[name] = (loglikelihoods(hf), loglikelihoods(served))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model folder (default: a tiny random Llama built here)")
    parser.add_argument("--adapter", action="append", default=[], metavar="NAME=DIR",
                        help="also score this LoRA adapter (repeatable)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    args = parser.parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as workdir:
        model = args.model or tiny_model(workdir)
        adapters = dict(item.split("=", 1) for item in args.adapter)
        results = compare(model, adapters, workdir)
    for name, (hf, served) in results.items():
        worst = max(abs(a - b) for a, b in zip(hf, served))
        good = len(hf) == len(served) == len(DOCS) and worst <= args.tolerance
        ok &= good
        print(f"{name}:\n{'doc':>4} {'hf':>14} {'local-completions':>18}")
        for i, (a, b) in enumerate(zip(hf, served)):
            print(f"{i:>4} {a:>14.6f} {b:>18.6f}")
        print(f"largest difference {worst:.2e} ({'within' if good else 'OVER'} {args.tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
