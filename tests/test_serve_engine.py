"""The serving engine (shardwise.apps.batching) on its own: the paged, prefix-cached KV cache
against the padded one and transformers' generate, per-request LoRA adapters against merged
models, logprobs and scoring against the model's own log-softmax, seeds, stop strings and
penalties. A tiny Llama with wide random weights (greedy answers differ per prompt), built locally.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "chat"))

from make_tiny_model import make_tiny_model  # noqa: E402

TEXTS = ["您好，请问是张先生吗？", "是。", "什么事。", "打扰您了，给您介绍下近期的优惠活动？", "不需要。",
         "Hello, how can I help you?", "Where is my parcel?", "[姓名]:张三\n[省份]:湖北"] * 10
PROMPTS = ["你好", "什么事。", "不需要。", "Hello", "Where is my parcel?", "是。"]
NEW = 12


def limits(**kw):
    from shardwise.apps.generation import GenerationLimits

    kw = {"max_new_tokens": NEW, "temperature": 0.0, "top_p": 1.0, **kw}
    return GenerationLimits(**kw)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("engine") / "model"), TEXTS, chat_template=True,
                           vocab_size=400, init_std=0.3, seed=3)


@pytest.fixture(scope="module")
def chat(model_dir):
    from shardwise.apps.generation import ChatModel

    return ChatModel.load(model_dir)


@pytest.fixture(scope="module")
def prompts(chat):
    return [chat.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture
def engine(chat):
    from shardwise.apps.batching import BatchedGenerator

    made = []

    def make(**kw):
        made.append(BatchedGenerator(chat, **{"max_batch_size": 16, **kw}))
        return made[-1]

    yield make
    for e in made:
        e.close()


def full_logprobs(model, ids: list[int], adapter_model=None) -> torch.Tensor:
    with torch.no_grad():
        logits = (adapter_model or model)(input_ids=torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), -1)


# ------------------------------------------------------------------ the paged cache decodes as before

def test_paged_greedy_equals_generate_and_the_padded_cache(chat, prompts, engine):
    reference = [chat.generate(p, limits()).text for p in prompts]  # transformers' generate
    for layout in ("paged", "padded"):
        e = engine(kv_cache=layout, kv_block_size=4)
        jobs = [e.submit(p, limits()) for p in prompts]
        assert [j.result(60).text for j in jobs] == reference, layout
        assert e.largest_batch > 1


def test_seeded_samples_do_not_depend_on_the_batch_or_the_cache(prompts, engine):
    sampled = limits(temperature=1.0, top_p=0.9)
    paged, padded = engine(kv_block_size=4), engine(kv_cache="padded")
    alone = [paged.submit(p, sampled, seed=7).result(60).token_ids for p in prompts]
    together = [j.result(60).token_ids for j in [paged.submit(p, sampled, seed=7) for p in prompts]]
    assert together == alone
    assert [padded.submit(p, sampled, seed=7).result(60).token_ids for p in prompts] == alone
    in_limits = paged.submit(prompts[0], limits(temperature=1.0, top_p=0.9, seed=7)).result(60).token_ids
    assert in_limits == alone[0]
    others = [paged.submit(prompts[0], sampled, seed=s).result(60).token_ids for s in range(4)]
    assert any(o != alone[0] for o in others)  # the seed does choose the samples


def test_logprobs_and_scores_are_the_models_log_softmax(chat, prompts, engine):
    e = engine(kv_block_size=4)
    answer = e.submit(prompts[1], limits(temperature=1.0), logprobs=3, seed=1).result(60)
    ids = prompts[1] + answer.token_ids
    lp = full_logprobs(chat.model, ids)
    assert len(answer.logprobs) == len(answer.token_ids) == answer.completion_tokens
    for i, entry in enumerate(answer.logprobs):
        row = lp[len(prompts[1]) - 1 + i]
        assert entry.token == answer.token_ids[i]
        assert entry.logprob == pytest.approx(float(row[entry.token]), abs=1e-4)
        values, top_ids = row.topk(3)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-4)
    scored = e.score(ids, top=2).result(60)
    assert scored[0].logprob is None and [s.token for s in scored] == ids
    for i in range(1, len(ids)):
        assert scored[i].logprob == pytest.approx(float(lp[i - 1, ids[i]]), abs=1e-4)
        assert [t for t, _ in scored[i].top] == lp[i - 1].topk(2).indices.tolist()
    assert e.submit(prompts[1], limits(), logprobs=0).result(60).logprobs[0].top == []
    with pytest.raises(ValueError, match="logprobs"):
        e.submit(prompts[1], limits(), logprobs=-1)


def test_stop_strings_end_the_answer_before_them_also_when_streamed(chat, prompts, engine):
    e = engine()
    full = e.submit(prompts[2], limits()).result(60)
    decode = lambda ids: chat.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    texts = [decode(full.token_ids[:k]) for k in range(len(full.token_ids) + 1)]
    # a stop string that begins with one token's whole text and ends inside the next token's:
    # streamed without holding text back, that first token's text would be sent
    k = next(k for k in range(1, len(texts) - 2) if "\ufffd" not in texts[k + 2] and
             len(texts[k + 1]) > len(texts[k]) and len(texts[k + 2]) > len(texts[k + 1]) and
             texts[k + 2].find(texts[k + 2][len(texts[k]):len(texts[k + 1]) + 1]) == len(texts[k]))
    stop = texts[k + 2][len(texts[k]):len(texts[k + 1]) + 1]
    pieces = []
    answer = e.submit(prompts[2], limits(stop=["never generated", stop]), on_text=pieces.append).result(60)
    assert answer.finish_reason == "stop" and answer.text == texts[k]
    assert "".join(pieces) == answer.text and all(stop not in p for p in pieces)
    assert answer.token_ids == full.token_ids[:k + 2]
    assert e.submit(prompts[2], limits(stop=stop)).result(60).text == answer.text  # one string, as OpenAI allows

    # text held back because it might begin a stop string is sent once it cannot
    tail = full.text[-1] + "\u2603never"
    pieces = []
    answer = e.submit(prompts[2], limits(stop=[tail]), on_text=pieces.append).result(60)
    assert answer.text == full.text and "".join(pieces) == full.text and answer.finish_reason == full.finish_reason


def test_presence_and_frequency_penalties_follow_openai(chat, prompts, engine):
    """Greedy under penalties equals a hand-written loop: logit - f * count - p * (count > 0)."""
    e = engine()
    plain = e.submit(prompts[0], limits()).result(60).token_ids
    for presence, frequency in ((0.0, 1.5), (2.0, 0.0), (-3.0, 0.5)):
        ids = list(prompts[0])
        counts = torch.zeros(chat.model.config.vocab_size)
        for _ in range(NEW):
            with torch.no_grad():
                logits = chat.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            token = int((logits - frequency * counts - presence * (counts > 0).float()).argmax())
            counts[token] += 1
            ids.append(token)
            if token == chat.tokenizer.eos_token_id:
                break
        got = e.submit(prompts[0], limits(presence_penalty=presence, frequency_penalty=frequency)).result(60)
        assert got.token_ids == ids[len(prompts[0]):], (presence, frequency)
        if presence < 0:
            assert got.token_ids != plain  # a strong enough penalty changes the answer


# ------------------------------------------------------------------ paged memory and prefix caching

def _long_prompt(chat, turns: int) -> list[int]:
    history = []
    for i in range(turns):
        history += [{"role": "user", "content": TEXTS[i % 8]}, {"role": "assistant", "content": TEXTS[(i + 3) % 8]}]
    return chat.prompt_ids(history + [{"role": "user", "content": "什么事。"}])


def test_kv_bytes_per_active_token_follow_the_formula(chat, prompts, engine):
    e = engine(kv_block_size=4)
    seen = []

    def snapshot(_text: str) -> None:  # runs in the generation thread, between steps
        stats = e.kv_cache_stats()
        seqs = [j._seq for j in e._batch.jobs]
        seen.append((stats, sum(-(-len(s.tokens) // 4) for s in seqs), sum(len(s.tokens) for s in seqs)))

    jobs = [e.submit(p, limits(), on_text=snapshot if i == 0 else None) for i, p in enumerate(prompts)]
    [j.result(60) for j in jobs]
    config = chat.model.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (config.hidden_size //
                                                                              config.num_attention_heads) * 4
    assert seen and len(seen[-1]) == 3
    for stats, blocks, tokens in seen:
        assert stats["bytes_per_token"] == per_token and stats["block_size"] == 4
        assert stats["blocks_used"] == blocks and stats["active_tokens"] == tokens
        assert stats["bytes_used"] == blocks * 4 * per_token < (tokens + 4 * stats["active_sequences"]) * per_token


def test_a_shared_prefix_is_computed_once_and_answers_the_same(chat, engine):
    history = _long_prompt(chat, 8)
    assert len(history) > 100
    padded = engine(kv_cache="padded")
    e = engine(kv_block_size=8)
    first = e.submit(history, limits()).result(60)
    assert first.cached_tokens == 0 and e.kv_cache_stats()["prefix_hits"] == 0
    again = e.submit(history, limits()).result(60)
    assert again.token_ids == first.token_ids
    full_blocks = len(history) // 8
    reused = full_blocks if len(history) % 8 else full_blocks - 1  # the last prompt token is always computed
    assert again.cached_tokens == reused * 8 and e.kv_cache_stats()["prefix_hits"] == reused

    # the next turn resends the history, the answer and a new question: all of that is reused
    follow = history + first.token_ids + chat.prompt_ids([{"role": "user", "content": "是。"}])
    hits_before = e.kv_cache_stats()["prefix_hits"]
    answer = e.submit(follow, limits()).result(60)
    written = len(history) + len(first.token_ids) - 1  # the last answer token's K/V was never computed
    assert answer.cached_tokens == written // 8 * 8
    assert e.kv_cache_stats()["prefix_hits"] - hits_before == written // 8
    assert answer.token_ids == padded.submit(follow, limits()).result(60).token_ids
    assert answer.token_ids == chat.generate(follow, limits()).token_ids

    # shorter prompts that share the prefix reuse its blocks too
    others = [e.submit(history[:len(history) - k], limits()) for k in (1, 2, 3)]
    assert all(j.result(60).cached_tokens > 0 for j in others)


def test_a_cache_smaller_than_the_demand_queues_instead_of_failing(chat, prompts, engine):
    from shardwise.apps.batching import RequestTooLarge

    longest = max(len(p) for p in prompts) + NEW
    per_token = engine(kv_block_size=4, max_batch_size=1).kv_cache_stats()["bytes_per_token"]
    small = engine(kv_block_size=4, kv_cache_bytes=per_token * (longest + 8))  # room for one request at a time
    jobs = [small.submit(p, limits()) for p in prompts]
    answers = [j.result(60) for j in jobs]
    reference = [chat.generate(p, limits()).text for p in prompts]
    assert [a.text for a in answers] == reference
    assert small.largest_batch == 1  # they waited for blocks rather than failed
    with pytest.raises(RequestTooLarge, match="kv_cache_bytes"):
        small.submit(prompts[0], limits(max_new_tokens=longest * 4))

    # cached blocks nobody uses give way, least recently used first
    stats = small.kv_cache_stats()
    assert stats["blocks_used"] == 0 and stats["blocks_cached"] > 0 and stats["evictions"] > 0


def test_a_bad_token_id_fails_alone(prompts, engine):
    from shardwise.apps.batching import RequestFailed

    e = engine()
    bad = e.submit(prompts[0] + [10 ** 6], limits())
    good = e.submit(prompts[1], limits())
    with pytest.raises(RequestFailed, match="outside the vocabulary"):
        bad.result(60)
    assert good.result(60).completion_tokens > 0
    with pytest.raises(RequestFailed, match="outside the vocabulary"):
        e.score([1, 10 ** 6]).result(60)


# ------------------------------------------------------------------ adapters per request

def _adapter(base_dir: str, out: str, seed: int, **lora) -> str:
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **lora)
    peft.get_peft_model(model, config).save_pretrained(out)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"qv": _adapter(model_dir, str(root / "qv"), 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
            "mlp": _adapter(model_dir, str(root / "mlp"), 2, r=8, lora_alpha=4, use_rslora=True,
                            target_modules=["o_proj", "gate_proj", "down_proj"])}


def test_an_adapter_answers_as_its_merged_model_and_mixed_batches_as_alone(chat, prompts, adapters, engine):
    from shardwise.apps.generation import ChatModel

    merged = {name: ChatModel.load(path) for name, path in adapters.items()}  # peft merge_and_unload
    prompts = prompts[:4]
    e = engine(adapters=adapters, kv_block_size=4)
    assert e.adapters == ["qv", "mlp"]
    expected = {None: [chat.generate(p, limits()).token_ids for p in prompts]}
    for name, model in merged.items():
        expected[name] = [model.generate(p, limits()).token_ids for p in prompts]
        assert expected[name] != expected[None]  # the adapter changes the answers
        alone = [e.submit(p, limits(), adapter=name).result(60).token_ids for p in prompts]
        assert alone == expected[name], name
        scored = e.score(prompts[0] + expected[name][0], adapter=name).result(60)
        lp = full_logprobs(model.model, prompts[0] + expected[name][0])
        ids = prompts[0] + expected[name][0]
        assert max(abs(scored[i].logprob - float(lp[i - 1, ids[i]])) for i in range(1, len(ids))) < 1e-4
    mixed = [(name, i, e.submit(p, limits(), adapter=name)) for i, p in enumerate(prompts) for name in expected]
    for name, i, job in mixed:
        assert job.result(60).token_ids == expected[name][i], (name, i)
    assert e.largest_batch >= 3
    padded = engine(adapters=adapters, kv_cache="padded")
    mixed = [(name, i, padded.submit(p, limits(), adapter=name)) for i, p in enumerate(prompts) for name in expected]
    assert all(job.result(60).token_ids == expected[name][i] for name, i, job in mixed)
    # the base model itself is untouched outside the engine's passes
    assert chat.generate(prompts[0], limits()).token_ids == expected[None][0]
    with pytest.raises(ValueError, match="unknown adapter 'nope' \\(loaded: qv, mlp\\)"):
        e.submit(prompts[0], limits(), adapter="nope")


def test_the_same_prompt_under_two_adapters_shares_no_blocks(chat, adapters, engine):
    e = engine(adapters=adapters, kv_block_size=4)
    history = _long_prompt(chat, 3)
    e.submit(history, limits()).result(60)
    assert e.submit(history, limits(), adapter="qv").result(60).cached_tokens == 0
    assert e.submit(history, limits(), adapter="qv").result(60).cached_tokens > 0


def test_bad_adapter_folders_are_refused_with_the_reason(chat, model_dir, tmp_path):
    import json

    from shardwise.apps.batching import BatchedGenerator

    with pytest.raises(ValueError, match="adapter 'x': .* is not a folder"):
        BatchedGenerator(chat, adapters={"x": str(tmp_path / "missing")})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        BatchedGenerator(chat, adapters={"x": str(tmp_path / "empty")})
    dora = _adapter(model_dir, str(tmp_path / "dora"), 3, r=2, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match="DoRA"):
        BatchedGenerator(chat, adapters={"x": dora})
    other = tmp_path / "other"
    other.mkdir()
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(2, 7),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 2)},
              str(other / "adapter_model.safetensors"))
    (other / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4}))
    with pytest.raises(ValueError, match="trained on another model"):
        BatchedGenerator(chat, adapters={"x": str(other)})
