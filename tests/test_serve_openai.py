"""`shardwise serve`'s OpenAI API driven by the official ``openai`` client (issue 42): models,
completions (text and token-id prompts, lists, n, stop, seed, logprobs with echo, penalties,
streaming with usage), chat completions with the same, adapters chosen by ``model``,
/tokenize and /detokenize, /metrics, and the 4xx answers to bad input.

One server (a subprocess started with ``--lora_modules``) serves every test. The references are
computed here with plain transformers/peft: greedy answers with ``generate``, logprobs with the
model's own log-softmax, an adapter's answers with its merged model.
"""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")  # a dev dependency (pyproject: shardwise[dev])

from test_serve import TEXTS, make_tiny_model, running_server  # noqa: E402

NEW_TOKENS = 12
PROMPTS = ["Hello", "Where is my parcel?", "什么事。", "不需要。"]


def make_adapter(base_dir: str, out_dir: str, seed: int) -> str:
    """A LoRA adapter folder as peft (and so ``shardwise finetune --lora_r``) writes it, with
    random factors large enough to change the greedy answers."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"],
                                                  lora_dropout=0.0, init_lora_weights=False))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    base = make_tiny_model(str(root / "model"), TEXTS, chat_template=True, vocab_size=400, init_std=0.3, seed=3)
    return {"base": base, "a": make_adapter(base, str(root / "lora-a"), 1),
            "b": make_adapter(base, str(root / "lora-b"), 2), "root": root}


@pytest.fixture(scope="module")
def server(dirs):
    log = str(dirs["root"] / "server.log")
    with running_server(dirs["base"], "--served_model_name", "tiny", "--lora_modules", f"a={dirs['a']}",
                        f"b={dirs['b']}", "--max_batch_size", "8", "--max_queue", "24", "--max_new_tokens", "64",
                        log_path=log) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(dirs):
    """Plain transformers models: the base and each adapter merged into it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(adapter=None):
        model = AutoModelForCausalLM.from_pretrained(dirs["base"], dtype=torch.float32).eval()
        if adapter:
            model = PeftModel.from_pretrained(model, dirs[adapter]).merge_and_unload().eval()
        return model

    return {"tok": AutoTokenizer.from_pretrained(dirs["base"]), "tiny": load(), "a": load("a"), "b": load("b")}


def greedy_ids(ref, name: str, ids: list[int], new: int = NEW_TOKENS) -> list[int]:
    tok = ref["tok"]
    x = torch.tensor([ids])
    out = ref[name].generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return out[0, len(ids):].tolist()


def greedy(ref, name: str, ids: list[int], new: int = NEW_TOKENS) -> str:
    return ref["tok"].decode(greedy_ids(ref, name, ids, new), skip_special_tokens=True)


def chat_ids(ref, messages) -> list[int]:
    """The prompt as the server renders it: the chat template's text, tokenised with BOS."""
    tok = ref["tok"]
    return tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))["input_ids"]


@torch.no_grad()
def log_softmax(ref, ids: list[int], name: str = "tiny") -> torch.Tensor:
    """(len(ids), vocab): row i is the model's log-distribution of the token after ids[:i+1]."""
    return torch.log_softmax(ref[name](torch.tensor([ids])).logits[0].double(), -1)


# ------------------------------------------------------------------------------------------- models

def test_models_lists_the_base_and_each_adapter(client, dirs):
    models = {m.id: m for m in client.models.list().data}
    assert list(models) == ["tiny", "a", "b"]
    assert models["a"].model_extra["parent"] == "tiny" and models["a"].model_extra["root"] == dirs["a"]
    assert models["tiny"].model_extra["parent"] is None and models["tiny"].owned_by == "shardwise"


# -------------------------------------------------------------------------------------- completions

def test_completions_greedy_equals_transformers_generate(client, ref):
    tok = ref["tok"]
    for prompt in PROMPTS[:2]:
        ids = tok(prompt)["input_ids"]
        expected = greedy(ref, "tiny", ids)
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
        assert r.object == "text_completion" and r.model == "tiny"
        assert r.choices[0].text == expected and r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.prompt_tokens == len(ids) and r.usage.total_tokens == len(ids) + r.usage.completion_tokens
        by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=NEW_TOKENS, temperature=0)
        assert by_ids.choices[0].text == expected
    # A list of prompts: a choice each, in order; as text or as token ids.
    many = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=NEW_TOKENS, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    expected = [greedy(ref, "tiny", tok(p)["input_ids"]) for p in PROMPTS]
    assert [c.text for c in many.choices] == expected
    assert many.usage.prompt_tokens == sum(len(tok(p)["input_ids"]) for p in PROMPTS)
    as_ids = client.completions.create(model="tiny", prompt=[tok(p)["input_ids"] for p in PROMPTS],
                                       max_tokens=NEW_TOKENS, temperature=0)
    assert [c.text for c in as_ids.choices] == expected


def test_completion_logprobs_with_echo_equal_the_models_log_softmax(client, ref):
    tok = ref["tok"]
    ids = tok("Where is my parcel? 什么事。")["input_ids"]
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=3)
    lp = r.choices[0].logprobs
    generated = lp.tokens[len(ids):]
    assert len(lp.tokens) == len(ids) + 1 and len(generated) == 1
    lsm = log_softmax(ref, ids)
    next_id = int(lsm[-1].argmax())
    full = ids + [next_id]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(full)):
        assert abs(lp.token_logprobs[i] - float(lsm[i - 1, full[i]])) <= 1e-4, i
        top = sorted(lp.top_logprobs[i].values(), reverse=True)
        expected_top = lsm[i - 1].topk(3).values.tolist()
        assert all(abs(a - b) <= 1e-4 for a, b in zip(top[:3], expected_top)), i
    pieces = [tok.decode([t]) for t in full]  # a token's text; a piece of a character as its bytes
    assert [p if "\ufffd" not in p else "bytes:" for p in pieces] == \
        [t if not t.startswith("bytes:\\x") else "bytes:" for t in lp.tokens]
    assert any(t.startswith("bytes:") for t in lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(full))]
    assert r.choices[0].text.startswith(tok.decode(ids)) and r.usage.completion_tokens == 1
    # max_tokens 0: the prompt is only scored.
    r0 = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert r0.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    assert r0.choices[0].text == tok.decode(ids) and r0.usage.completion_tokens == 0
    # Without echo: logprobs of the generated tokens only, at every step of a longer answer.
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    out = greedy_ids(ref, "tiny", ids, 6)
    lsm = log_softmax(ref, ids + out)
    assert len(lp.token_logprobs) == r.usage.completion_tokens == len(out)
    for k, value in enumerate(lp.token_logprobs):
        assert abs(value - float(lsm[len(ids) - 1 + k, out[k]])) <= 1e-4, k


def test_same_seed_same_samples_and_n(client):
    kw = dict(model="tiny", prompt="Hello", max_tokens=10, temperature=1.0)
    first = client.completions.create(n=3, seed=11, **kw)
    again = client.completions.create(n=3, seed=11, **kw)
    other = client.completions.create(n=1, seed=12, **kw)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts)) >= 2  # the choices are different samples
    assert other.choices[0].text == texts[1]  # choice j is sampled with seed + j


def test_stop_strings_and_penalties(client, ref):
    tok = ref["tok"]
    ids = tok("Where is my parcel?")["input_ids"]
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0).choices[0].text
    assert len(plain) >= 6
    stop = plain[3:5]
    cut = client.completions.create(model="tiny", prompt=ids, max_tokens=20, temperature=0, stop=[stop, "@@"])
    assert cut.choices[0].text == plain[:plain.index(stop)] and cut.choices[0].finish_reason == "stop"

    # OpenAI's penalties: logit -= frequency * count + presence * (count > 0), over generated tokens.
    changed = []
    for presence, frequency in ((0.0, 2.0), (1.5, 0.0)):
        seq, counts = list(ids), torch.zeros(len(tok), dtype=torch.float64)
        with torch.no_grad():
            for _ in range(10):
                logits = ref["tiny"](torch.tensor([seq])).logits[0, -1].double()
                nxt = int((logits - frequency * counts - presence * (counts > 0).double()).argmax())
                seq.append(nxt)
                counts[nxt] += 1
                if nxt == tok.eos_token_id:
                    break
        expected = tok.decode(seq[len(ids):], skip_special_tokens=True)
        got = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0,
                                        presence_penalty=presence, frequency_penalty=frequency)
        assert got.choices[0].text == expected, (presence, frequency)
        changed.append(not plain.startswith(expected))
    assert any(changed)  # the penalties really changed the answer


def test_completion_streaming_with_usage(client):
    kw = dict(model="tiny", prompt=["Hello", "什么事。"], max_tokens=10, temperature=1.0, seed=5, n=2, logprobs=1)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == whole.usage.completion_tokens
    assert usage.usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    texts, finish, lps = {}, {}, {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + ch.text
            lps.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs if ch.logprobs else [])
            if ch.finish_reason:
                finish[ch.index] = ch.finish_reason
    for ch in whole.choices:
        assert texts[ch.index] == ch.text and finish[ch.index] == ch.finish_reason
        assert lps[ch.index] == pytest.approx(ch.logprobs.token_logprobs, abs=1e-6)
    assert len(chunks) > 8  # the text came in pieces



# ------------------------------------------------------------------------------------------- chat

def test_chat_n_seed_logprobs_and_streaming(client, ref):
    tok = ref["tok"]
    messages = [{"role": "user", "content": "Where is my parcel?"}]
    ids = chat_ids(ref, messages)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                                       logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.message.content == greedy(ref, "tiny", ids)
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens and r.usage.prompt_tokens == len(ids)
    out = greedy_ids(ref, "tiny", ids)
    lsm = log_softmax(ref, ids + out)
    assert len(content) == len(out)
    for k, item in enumerate(content):
        assert abs(item.logprob - float(lsm[len(ids) - 1 + k, out[k]])) <= 1e-4
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-6)
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token or item.token.startswith("bytes:")

    kw = dict(model="tiny", messages=messages, max_tokens=8, temperature=1.0, seed=3, n=3)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) >= 2
    assert a.usage.completion_tokens >= sum(c.finish_reason == "length" for c in a.choices) * 8

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == a.usage.total_tokens
    texts = {}
    for c in chunks[:-1]:
        for ch in c.choices:
            texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
    assert [texts[i] for i in range(3)] == [c.message.content for c in a.choices]


# ----------------------------------------------------------------------------------------- adapters

def test_adapters_equal_their_merged_models_and_batch_together(client, ref):
    tok = ref["tok"]
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:3]]
    expected = {name: [greedy(ref, name, ids) for ids in prompts] for name in ("tiny", "a", "b")}
    assert expected["a"] != expected["tiny"] and expected["b"] != expected["a"]  # the adapters change the answers

    def ask(name, ids):
        return client.completions.create(model=name, prompt=ids, max_tokens=NEW_TOKENS, temperature=0).choices[0].text

    alone = {name: [ask(name, ids) for ids in prompts] for name in ("a",)}
    assert alone["a"] == expected["a"]
    jobs = [(name, i) for i in range(len(prompts)) for name in ("tiny", "a", "b")]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        mixed = list(pool.map(lambda job: ask(job[0], prompts[job[1]]), jobs))
    for (name, i), text in zip(jobs, mixed):
        assert text == expected[name][i], (name, i)
    # chat completions pick the adapter the same way
    r = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hello"}],
                                       max_tokens=NEW_TOKENS, temperature=0)
    ids = chat_ids(ref, [{"role": "user", "content": "Hello"}])
    assert r.choices[0].message.content == greedy(ref, "b", ids) and r.model == "b"


# ------------------------------------------------------------------------------ tokenize, metrics

def test_tokenize_detokenize(server, ref):
    tok = ref["tok"]
    r = httpx.post(server + "/tokenize", json={"model": "tiny", "prompt": "Where is my parcel?"}, timeout=30).json()
    assert r["tokens"] == tok("Where is my parcel?")["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 512
    plain = httpx.post(server + "/tokenize", json={"prompt": "Hello", "add_special_tokens": False,
                                                   "return_token_strs": True}, timeout=30).json()
    assert plain["tokens"] == tok("Hello", add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    messages = [{"role": "user", "content": "你好"}]
    chat = httpx.post(server + "/tokenize", json={"messages": messages}, timeout=30).json()
    assert tok.decode(chat["tokens"]) == "<s><|user|>你好<|assistant|>"
    back = httpx.post(server + "/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()
    assert back["prompt"] == tok.decode(r["tokens"])
    bad = httpx.post(server + "/detokenize", json={"tokens": [1, 100000]}, timeout=30)
    assert bad.status_code == 400 and "tokens[1]: token id 100000 is outside the vocabulary" in bad.text


def test_metrics(server, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model="tiny", prompt="Hello", max_tokens=5, temperature=0)
    text = httpx.get(server + "/metrics", timeout=30)
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(text.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("shardwise_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] >= 1
    assert samples[("shardwise_generation_tokens_total", ())] >= 5
    assert samples[("shardwise_prompt_tokens_total", ())] >= 2
    assert samples[("shardwise_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("shardwise_time_per_output_token_seconds_count", ())] >= 1
    assert ("shardwise_requests_running", ()) in samples and ("shardwise_requests_waiting", ()) in samples
    assert samples[("shardwise_kv_cache_blocks_total", ())] > 0
    assert 0 <= samples[("shardwise_kv_cache_usage_ratio", ())] <= 1
    before = samples.get(("shardwise_requests_total", (("endpoint", "/v1/completions"), ("status", "404"))), 0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hello", max_tokens=2)
    after = httpx.get(server + "/metrics", timeout=30).text
    assert f'shardwise_requests_total{{endpoint="/v1/completions",status="404"}} {before + 1:.1f}' in after


# ------------------------------------------------------------------------------------- bad input

def test_bad_input_gets_4xx_with_a_reason(client, server):
    cases = [
        (openai.NotFoundError, "model 'nope' does not exist", dict(model="nope", prompt="x")),
        (openai.UnprocessableEntityError, "n:", dict(model="tiny", prompt="x", n=0)),
        (openai.UnprocessableEntityError, "n:", dict(model="tiny", prompt="x", n=129)),
        (openai.UnprocessableEntityError, "logprobs:", dict(model="tiny", prompt="x", logprobs=6)),
        (openai.UnprocessableEntityError, "echo cannot be combined with stream",
         dict(model="tiny", prompt="x", echo=True, stream=True)),
        (openai.BadRequestError, "prompt[2]: token id 400 is outside the vocabulary",
         dict(model="tiny", prompt=[1, 2, 400])),
        (openai.BadRequestError, "prompt[1][0]: token id -1 is outside the vocabulary",
         dict(model="tiny", prompt=[[5], [-1]])),
        (openai.UnprocessableEntityError, "max_tokens 0", dict(model="tiny", prompt="x", max_tokens=0)),
        (openai.BadRequestError, "more than this server runs or queues",
         dict(model="tiny", prompt=["a", "b", "c"], n=20)),
        (openai.UnprocessableEntityError, "presence_penalty", dict(model="tiny", prompt="x", presence_penalty=3)),
        (openai.UnprocessableEntityError, "stop", dict(model="tiny", prompt="x", stop=["a", "b", "c", "d", "e"])),
    ]
    for error, fragment, kw in cases:
        with pytest.raises(error) as info:
            client.completions.create(**kw)
        assert fragment in info.value.message, (kw, info.value.message)
    chat_cases = [
        (openai.NotFoundError, "model 'c' does not exist", dict(model="c")),
        (openai.UnprocessableEntityError, "top_logprobs:", dict(model="tiny", logprobs=True, top_logprobs=21)),
        (openai.UnprocessableEntityError, "top_logprobs needs logprobs", dict(model="tiny", top_logprobs=2)),
        (openai.UnprocessableEntityError, "n:", dict(model="tiny", n=0)),
    ]
    for error, fragment, kw in chat_cases:
        with pytest.raises(error) as info:
            client.chat.completions.create(messages=[{"role": "user", "content": "x"}], **kw)
        assert fragment in info.value.message, (kw, info.value.message)
    assert httpx.get(server + "/health", timeout=10).json()["status"] == "ok"
    assert httpx.get(server + "/health", timeout=10).json()["active_requests"] == 0


def test_lora_modules_flag_errors(dirs, capsys):
    from shardwise.apps.serve import main

    for spec, fragment in (("noequals", "is not NAME=DIR"), (f"tiny={dirs['a']}", "is the base model's name"),
                           (f"x={dirs['root']}", "has no adapter_config.json"), ("x=/does/not/exist", "not a folder")):
        assert main(["--model", dirs["base"], "--served_model_name", "tiny", "--lora_modules", spec]) == 2
        assert fragment in capsys.readouterr().err, spec
    assert main(["--model", dirs["base"], "--lora_modules", f"a={dirs['a']}", f"a={dirs['b']}"]) == 2
    assert "given twice" in capsys.readouterr().err
