"""`shardwise serve` as a real subprocess: the prompt/history contract, the OpenAI endpoint
(plain and streaming), health, bad requests, and concurrent clients.

The model is a tiny Llama with random weights drawn wide enough (std 0.3) that greedy answers
differ from prompt to prompt, and a tokenizer with a chat template, both built locally.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from distributed import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "chat"))

from make_tiny_model import make_tiny_model  # noqa: E402

TEXTS = ["您好，请问是张先生吗？", "是。", "什么事。", "打扰您了，给您介绍下近期的优惠活动？", "不需要。",
         "Hello, how can I help you?", "Where is my parcel?", "[姓名]:张三\n[省份]:湖北"] * 10
NEW_TOKENS = 12
PROMPTS = ["你好", "什么事。", "不需要。", "Hello", "Where is my parcel?", "是。", "湖北", "张三"]


@contextlib.contextmanager
def running_server(model_dir: str, *extra: str, log_path: str, timeout: float = 300.0):
    """Start ``shardwise serve`` on a free port; yield its URL once /health answers; stop it."""
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "shardwise", "serve", "--model", model_dir, "--port", str(port),
                             *extra], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{open(log_path).read()}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"server not up after {timeout}s:\n{open(log_path).read()}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("serve") / "model"), TEXTS, chat_template=True,
                           vocab_size=400, init_std=0.3, seed=3)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("serve-log") / "server.log")
    with running_server(model_dir, "--max_concurrency", "2", "--max_queue", "16", "--max_new_tokens",
                        str(NEW_TOKENS), "--served_model_name", "tiny", log_path=log) as url:
        yield url


def reference_answer(model_dir: str, rendered: str) -> str:
    """Greedy decoding done here with plain transformers, from a prompt rendered by hand."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok(rendered)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_prompt_history_contract(server, model_dir):
    # As curl -d sends it: no JSON content type.
    r = httpx.post(server, content='{"prompt": "你好", "history": []}'.encode(), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"response", "history", "status", "time"}
    assert body["status"] == 200 and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", body["time"])
    assert body["response"] == reference_answer(model_dir, "<|user|>你好<|assistant|>")
    assert body["history"] == [["你好", body["response"]]]

    history = [["", "您好，请问是张先生吗？"], ["是。", "喂"]]
    r = httpx.post(server, json={"prompt": "什么事。", "history": history, "max_length": 100}, timeout=60)
    body = r.json()
    rendered = "<|user|><|assistant|>您好，请问是张先生吗？</s><|user|>是。<|assistant|>喂</s><|user|>什么事。<|assistant|>"
    assert body["response"] == reference_answer(model_dir, rendered)
    assert body["history"] == history + [["什么事。", body["response"]]]


def test_openai_endpoint_plain_and_streaming(server):
    req = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    r = httpx.post(server + "/v1/chat/completions", json=req, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    assert 1 <= body["usage"]["completion_tokens"] <= 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]

    events = []
    with httpx.stream("POST", server + "/v1/chat/completions", json={**req, "stream": True}, timeout=60) as s:
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        for line in s.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == choice["message"]["content"]
    assert len(chunks) >= 3  # the answer came in pieces, not in one block


BAD = [
    ("/", b"{not json", 400, "not valid JSON"),
    ("/", b"", 400, "not valid JSON"),
    ("/", b"[1, 2]", 422, "body"),
    ("/", b'{"history": []}', 422, "prompt: Field required"),
    ("/", b'{"prompt": 5}', 422, "prompt"),
    ("/", b'{"prompt": "x", "history": [["only one"]]}', 422, "history[0]"),
    ("/", b'{"prompt": "x", "history": "no"}', 422, "history"),
    ("/", b'{"prompt": "x", "temperature": "hot"}', 422, "temperature: must be a number"),
    ("/", b'{"prompt": "x", "top_p": 1.5}', 422, "top_p"),
    ("/", b'{"prompt": "x", "temperature": NaN}', 422, "temperature: must be a finite number"),
    ("/", b'{"prompt": "x", "top_p": NaN}', 422, "top_p: must be a finite number"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', 422,
     "temperature: must be a finite number"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}', 422,
     "top_p: must be a finite number"),
    ("/", b'{"prompt": "x", "max_length": 100000}', 400, "context of 512"),
    ("/", json.dumps({"prompt": "Where is my parcel? " * 200}).encode(), 400, "leaves no room"),
    ("/v1/chat/completions", b'{"messages": []}', 422, "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "bot", "content": "x"}]}', 422, "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "stream": "yes"}', 422, "stream"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 600}', 400,
     "context of 512"),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    for path, body, status, fragment in BAD:
        r = httpx.post(server + path, content=body, timeout=60)
        assert r.status_code == status, (body, r.status_code, r.text)
        message = r.json()["error"]["message"]
        assert fragment in message, (body, message)
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ok"
    assert httpx.post(server, json={"prompt": "你好"}, timeout=60).status_code == 200


def test_eight_concurrent_clients_get_their_own_answers(server):
    sequential = {p: httpx.post(server, json={"prompt": p}, timeout=60).json()["response"] for p in PROMPTS}
    assert len(set(sequential.values())) >= 4  # the prompts really lead to different answers
    results: dict[str, object] = {}
    barrier = threading.Barrier(len(PROMPTS))

    def client(prompt: str) -> None:
        barrier.wait(timeout=30)
        try:
            r = httpx.post(server, json={"prompt": prompt, "history": []}, timeout=120)
            results[prompt] = (r.status_code, r.json())
        except Exception as exc:  # recorded, so the assertion below names it
            results[prompt] = exc

    threads = [threading.Thread(target=client, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert len(results) == len(PROMPTS), results
    for prompt in PROMPTS:
        status, body = results[prompt]
        assert status == 200, body
        assert body["response"] == sequential[prompt] and body["history"] == [[prompt, sequential[prompt]]]


def test_requests_over_the_queue_limit_get_503(model_dir):
    from shardwise.apps.generation import ChatModel
    from shardwise.apps.serve import ServeSettings, create_app

    app = create_app(ChatModel.load(model_dir), ServeSettings(max_batch_size=1, max_queue=1, max_new_tokens=100))
    gate = app.state.gate
    long_request = {"prompt": "Where is my parcel?", "temperature": 1.0}  # sampling: no early EOS to count on

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            busy = [asyncio.create_task(client.post("/", json=long_request)) for _ in range(2)]
            for _ in range(400):  # one generating, one waiting
                if gate.active == 2:
                    break
                await asyncio.sleep(0.01)
            assert gate.active == 2
            refused = await client.post("/", json={"prompt": "你好"})
            refused_stream = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "你好"}], "stream": True})
            done = await asyncio.gather(*busy)
            after = await client.post("/", json={"prompt": "你好", "max_length": 40})
            return refused, refused_stream, [r.status_code for r in done], after.status_code

    refused, refused_stream, done, after = asyncio.run(scenario())
    for r in (refused, refused_stream):
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "server busy" in message and "--max_queue" in message
    assert done == [200, 200] and after == 200 and gate.active == 0


# ---------------------------------------------------------------- reliability and batching

def test_oversized_body_gets_413_before_parsing(server):
    body = json.dumps({"prompt": "x" * 8_000_000}).encode()  # over the default --max_body_bytes (4 MiB)
    started = time.monotonic()
    r = httpx.post(server, content=body, timeout=60)
    assert r.status_code == 413, r.text
    assert "--max_body_bytes" in r.json()["error"]["message"]
    assert time.monotonic() - started < 30
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ok"


def _in_process(app):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)


def test_slow_tokenising_does_not_block_the_event_loop(model_dir):
    """GET /health answers while a huge prompt is being parsed and tokenised (which must not run on the
    event loop). A tokenizer slowed to 2 s per call stands in for the huge prompt."""
    from shardwise.apps.generation import ChatModel
    from shardwise.apps.serve import ServeSettings, create_app

    chat = ChatModel.load(model_dir)
    fast = chat.prompt_ids

    def slow(messages):
        time.sleep(2.0)
        return fast(messages)

    chat.prompt_ids = slow
    app = create_app(chat, ServeSettings(max_new_tokens=4))

    async def scenario():
        async with _in_process(app) as client:
            big = asyncio.create_task(client.post("/", json={"prompt": "Where is my parcel? " * 1000}))
            started = time.monotonic()
            await asyncio.sleep(0.3)  # the request is being tokenised now (a blocked loop wakes us late)
            health = await client.get("/health")
            waited = time.monotonic() - started
            return health.status_code, waited, (await big).status_code

    status, waited, big_status = asyncio.run(scenario())
    assert status == 200 and big_status == 400  # too long for the context: refused after tokenising
    assert waited < 1.5, f"0.3 s of sleep and /health took {waited:.2f} s beside a request being tokenised"


def test_api_key_and_request_timeout(model_dir):
    from shardwise.apps.generation import ChatModel
    from shardwise.apps.serve import ServeSettings, create_app

    chat = ChatModel.load(model_dir)
    keyed = create_app(chat, ServeSettings(api_key="s3cret", max_new_tokens=4))
    hurried = create_app(chat, ServeSettings(request_timeout=1e-4, max_new_tokens=50))

    async def scenario():
        out = {}
        async with _in_process(keyed) as client:
            body = {"messages": [{"role": "user", "content": "你好"}]}
            out["none"] = await client.post("/v1/chat/completions", json=body)
            out["wrong"] = await client.post("/v1/chat/completions", json=body,
                                             headers={"Authorization": "Bearer nope"})
            out["health"] = await client.get("/health")
            out["models"] = await client.get("/v1/models")
            out["metrics"] = await client.get("/metrics")
            out["completions"] = await client.post("/v1/completions", json={"prompt": "x"})
            out["tokenize"] = await client.post("/tokenize", json={"prompt": "x"})
            out["models_ok"] = await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
            out["right"] = await client.post("/v1/chat/completions", json=body,
                                             headers={"Authorization": "Bearer s3cret"})
        async with _in_process(hurried) as client:
            out["late"] = await client.post("/", json={"prompt": "Where is my parcel?"})
        return out

    out = asyncio.run(scenario())
    assert out["models_ok"].status_code == 200 and out["models_ok"].json()["data"][0]["object"] == "model"
    for key in ("none", "wrong", "health", "models", "metrics", "completions", "tokenize"):
        assert out[key].status_code == 401, (key, out[key].text)
        assert out[key].headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in out[key].json()["error"]["message"]
    assert out["right"].status_code == 200, out["right"].text
    assert out["late"].status_code == 504, out["late"].text
    assert "--request_timeout" in out["late"].json()["error"]["message"]
    assert hurried.state.gate.active == 0


def test_requests_join_the_running_batch_and_answer_as_alone(model_dir):
    """A request submitted while another is generating joins its batch at a step boundary; both
    answers equal what each gets alone, and the steps are shared."""
    from shardwise.apps.batching import BatchedGenerator
    from shardwise.apps.generation import ChatModel, GenerationLimits

    chat = ChatModel.load(model_dir)
    lim = GenerationLimits(max_new_tokens=NEW_TOKENS * 3, temperature=0.0, top_p=1.0)
    prompts = [chat.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]
    alone = BatchedGenerator(chat, max_batch_size=1)
    solo = [alone.submit(ids, lim).result(timeout=120) for ids in prompts]
    alone.close()
    assert len({a.text for a in solo}) >= 4

    engine = BatchedGenerator(chat, max_batch_size=4)
    first = engine.submit(prompts[4], lim)
    deadline = time.monotonic() + 60
    while len(first.tokens) < 2 and not first.future.done() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert not first.future.done(), "pick a prompt whose answer is longer than two tokens"
    later = [engine.submit(ids, lim) for i, ids in enumerate(prompts) if i != 4]
    answers = {4: first.result(timeout=120)}
    answers.update({i: job.result(timeout=120) for i, job in zip([i for i in range(len(prompts)) if i != 4], later)})
    engine.close()
    for i, answer in answers.items():
        assert answer.text == solo[i].text and answer.finish_reason == solo[i].finish_reason, i
    total = sum(a.completion_tokens for a in answers.values())
    assert engine.largest_batch == 4
    assert engine.steps < total - len(answers) - 8, (engine.steps, total)  # steps were shared
    assert engine.prefill_passes < len(prompts), engine.prefill_passes  # joiners were prefilled together
