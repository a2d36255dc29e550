"""Chat rendering, tokenisation and masking; record reading; metrics; the lazy sampler.

Expected layouts are written out by hand here (the template text, then the tokenizer applied to
it), independently of the code under test.
"""
from __future__ import annotations

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "chat"))

from make_tiny_model import build_tokenizer  # noqa: E402

from shardwise.apps.metrics import bleu4, rouge_l, score, units  # noqa: E402
from shardwise.data import IGNORE_INDEX, ChatEncoder, history_to_messages  # noqa: E402
from shardwise.data.chat import messages_to_pairs  # noqa: E402
from shardwise.data.records import BadRecord, Columns, read_records  # noqa: E402
from shardwise.data.sampler import LazyPermutation, ShardSampler  # noqa: E402

TEXTS = ["什么事。", "打扰您了，给您介绍下近期的优惠活动？", "您好，请问是张先生吗？", "是。",
         "喂，您好，我这是您专属客服顾问。", "[姓名]:张三\n[年龄]:45.0\n[性别]:男士\n[省份]:湖北",
         "Hello, how can I help you today?", "My order has not arrived yet."] * 5


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(TEXTS, vocab_size=400)


@pytest.fixture(scope="module")
def chat_tok():
    return build_tokenizer(TEXTS, vocab_size=400, chat_template=True)


def ids(tokenizer, text, special):
    return tokenizer(text, add_special_tokens=special)["input_ids"]


# ---------------------------------------------------------------- layout and masking

def test_round_template_without_history(tok):
    enc = ChatEncoder(tok, max_source_length=200, max_target_length=50)
    out = enc.encode(history_to_messages("什么事。", []), "打扰您了")
    src = ids(tok, "[Round 1]\n\n问：什么事。\n\n答：", True)
    tgt = ids(tok, "打扰您了", False) + [tok.eos_token_id]
    assert src[0] == tok.bos_token_id
    assert out.input_ids == src + tgt
    assert out.source_length == len(src)
    assert out.labels == [IGNORE_INDEX] * len(src) + tgt


def test_round_template_with_history_and_agent_first(tok):
    enc = ChatEncoder(tok, max_source_length=200, max_target_length=50)
    history = [["", "您好，请问是张先生吗？"], ["是。", "喂，您好。"]]
    out = enc.encode(history_to_messages("什么事。", history), "打扰您了")
    text = ("[Round 1]\n\n问：\n\n答：您好，请问是张先生吗？\n\n"
            "[Round 2]\n\n问：是。\n\n答：喂，您好。\n\n"
            "[Round 3]\n\n问：什么事。\n\n答：")
    src = ids(tok, text, True)
    assert out.input_ids == src + ids(tok, "打扰您了", False) + [tok.eos_token_id]
    assert out.labels[:len(src)] == [IGNORE_INDEX] * len(src)
    assert out.labels[len(src):] == out.input_ids[len(src):]


def test_chat_template_layout_has_one_eos(chat_tok):
    enc = ChatEncoder(chat_tok, max_source_length=200, max_target_length=50)
    assert enc.template == "chat"
    out = enc.encode(history_to_messages("Hello", [["", "您好"], ["是。", "喂"]]), "My order")
    src = ids(chat_tok, "<|user|><|assistant|>您好</s><|user|>是。<|assistant|>喂</s><|user|>Hello<|assistant|>", True)
    tgt = ids(chat_tok, "My order", False) + [chat_tok.eos_token_id]
    assert out.input_ids == src + tgt
    assert out.source_length == len(src)
    assert out.input_ids.count(chat_tok.eos_token_id) == 3  # two history answers + the response's


def test_template_choice_errors(tok):
    with pytest.raises(ValueError, match="no chat_template"):
        ChatEncoder(tok, template="chat")
    with pytest.raises(ValueError, match="max_target_length must be at least 2"):
        ChatEncoder(tok, max_target_length=1)


def test_truncation_drops_oldest_rounds_and_keeps_the_response(tok):
    history = [["是。", "喂，您好，我这是您专属客服顾问。"]] * 3 + [["", "您好，请问是张先生吗？"]]
    full = ChatEncoder(tok).encode(history_to_messages("什么事。", history), "打扰您了")
    last_round = ids(tok, "[Round 1]\n\n问：\n\n答：您好，请问是张先生吗？\n\n[Round 2]\n\n问：什么事。\n\n答：", True)
    limit = len(last_round) + 2  # room for the newest round only
    assert full.source_length > limit
    out = ChatEncoder(tok, max_source_length=limit, max_target_length=50).encode(
        history_to_messages("什么事。", history), "打扰您了")
    assert out.input_ids[:out.source_length] == last_round
    assert out.input_ids[out.source_length:] == ids(tok, "打扰您了", False) + [tok.eos_token_id]


def test_truncation_of_a_long_query_keeps_bos_and_tail(tok):
    query = "Hello, how can I help you today? " * 20
    src = ids(tok, f"[Round 1]\n\n问：{query}\n\n答：", True)
    out = ChatEncoder(tok, max_source_length=16, max_target_length=50).encode(history_to_messages(query, []), "是。")
    assert out.source_length == 16
    assert out.input_ids[:16] == [tok.bos_token_id] + src[-15:]
    assert out.input_ids[16:] == ids(tok, "是。", False) + [tok.eos_token_id]


def test_long_response_is_cut_with_eos_last(tok):
    response = "喂，您好，我这是您专属客服顾问。" * 10
    out = ChatEncoder(tok, max_source_length=64, max_target_length=6).encode(history_to_messages("是。", []), response)
    target = out.input_ids[out.source_length:]
    assert target == ids(tok, response, False)[:5] + [tok.eos_token_id]


def test_messages_must_alternate_and_end_with_user():
    assert messages_to_pairs([{"role": "system", "content": "S"}, {"role": "assistant", "content": "A"},
                              {"role": "user", "content": "Q"}]) == ("S", [("", "A")], "Q")
    with pytest.raises(ValueError, match="two user messages in a row"):
        messages_to_pairs([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="end with a user message"):
        messages_to_pairs([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])


# ---------------------------------------------------------------- records

GOOD = {"prompt": "p", "response": "r", "history": [["q", "a"]]}


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_bad_records_name_file_and_line(tmp_path):
    lines = [json.dumps(GOOD), "", "{not json", json.dumps({"promt": "p", "response": "r"}),
             json.dumps({"prompt": "p", "response": 3}), json.dumps({**GOOD, "history": [["only one"]]}),
             json.dumps({**GOOD, "history": "x"}), "[1, 2]", json.dumps({"prompt": "p", "response": "r", "history": None})]
    path = _write(tmp_path / "train.json", lines)
    items = list(read_records(path, Columns()))
    bad = [str(i) for i in items if isinstance(i, BadRecord)]
    assert bad[0].startswith("train.json:3: not valid JSON")
    assert bad[1].startswith("train.json:4: no 'prompt' key") and "did you mean 'promt'" in bad[1]
    assert bad[2] == "train.json:5: 'response' must be a string, got int"
    assert bad[3].startswith("train.json:6: history[0] must be a [query, answer] pair")
    assert bad[4].startswith("train.json:7: 'history' must be a list")
    assert bad[5] == "train.json:8: expected a JSON object, got list"
    good = [i for i in items if not isinstance(i, BadRecord)]
    assert [str(g[0]) for g in good] == ["train.json:1", "train.json:9"]
    assert good[1][1] == [{"role": "user", "content": "p"}]


def test_json_array_files_and_custom_columns(tmp_path):
    path = tmp_path / "dev.json"
    path.write_text('[\n {"q": "a", "ans": "b"},\n\n {"q": "c", "ans": 5}\n]\n')
    items = list(read_records(str(path), Columns(prompt="q", response="ans", history=None)))
    assert str(items[0][0]) == "dev.json:2 (element 0)" and items[0][2] == "b"
    assert str(items[1]) == "dev.json:4 (element 1): 'ans' must be a string, got int"
    (tmp_path / "broken.json").write_text('[{"q": "a", "ans": "b"}\n {"q": 1}]')
    with pytest.raises(BadRecord, match=r"broken.json:2 \(after element 0\): not a valid JSON array"):
        list(read_records(str(tmp_path / "broken.json"), Columns(prompt="q", response="ans")))



def test_long_lines_are_refused_without_being_read_and_reading_goes_on(tmp_path):
    """A line over the limit is never read whole (a 78 MB line would take about 11 GB): it is a bad
    record naming file and line, skipped in bounded pieces; the records after it are read."""
    import tracemalloc

    path = tmp_path / "train.jsonl"
    huge = json.dumps({"prompt": "x" * 20_000_000, "response": "r"})
    _write(path, [json.dumps({"prompt": "a", "response": "first"}), huge,
                  json.dumps({"prompt": "b", "response": "after"})])
    tracemalloc.start()
    items = list(read_records(str(path), Columns(), max_record_bytes=1 << 20))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 8 << 20, f"reading held {peak / 1e6:.0f} MB"
    assert [str(i) for i in items if isinstance(i, BadRecord)] == [
        f"train.jsonl:2: the record is {len(huge) + 1} bytes, more than the limit of {1 << 20} (--max_record_bytes); "
        "it was not read into memory"]
    assert [i[2] for i in items if not isinstance(i, BadRecord)] == ["first", "after"]
    # Split into parts at arbitrary byte offsets, every record is still seen once.
    parts = [str(i) if isinstance(i, BadRecord) else i[2]
             for p in range(3) for i in read_records(str(path), Columns(), part=p, parts=3, max_record_bytes=1 << 20)]
    assert len(parts) == 3 and "first" in parts and "after" in parts


def test_duplicate_keys_are_refused_and_array_errors_name_the_element(tmp_path):
    lines = ['{"prompt": "a", "response": "r"}', '{"prompt": "a", "response": "r", "prompt": "b"}',
             '{"prompt": "a", "response": "r", "history": [["q", "x"]], "meta": {"k": 1, "k": 2}}']
    _write(tmp_path / "d.jsonl", lines)
    bad = [str(i) for i in read_records(str(tmp_path / "d.jsonl"), Columns()) if isinstance(i, BadRecord)]
    assert bad == ["d.jsonl:2: the key 'prompt' appears twice in one object (which value counts would be a "
                   "guess); keep one of them", "d.jsonl:3: the key 'k' appears twice in one object (which value "
                   "counts would be a guess); keep one of them"]

    array = '[{"prompt": "a", "response": "r"}, 7, {"prompt": "a", "response": "r", "response": "s"}, ' + \
            '{"prompt": "' + "y" * 3000 + '", "response": "r"}, {"prompt": "ok", "response": "fine"}]'
    (tmp_path / "d.json").write_text(array)
    items = list(read_records(str(tmp_path / "d.json"), Columns(), max_record_bytes=2000))
    assert [str(i) for i in items if isinstance(i, BadRecord)] == [
        "d.json:1 (element 1): expected a JSON object, got int",
        "d.json:1 (element 2): the key 'response' appears twice in one object (which value counts would be a "
        "guess); keep one of them",
        "d.json:1 (element 3): the record is 3031 bytes, more than the limit of 2000 (--max_record_bytes) (a JSON "
        "array is read whole: use JSON lines for large data)"]
    assert [str(i[0]) for i in items if not isinstance(i, BadRecord)] == ["d.json:1 (element 0)", "d.json:1 (element 4)"]
    (tmp_path / "broken.json").write_text('[{"prompt": "a", "response": "r"}, {"prompt": "a" "response": "r"}]')
    with pytest.raises(BadRecord, match=r"broken.json:1 \(element 1\): not a valid JSON array \(Expecting ','"):
        list(read_records(str(tmp_path / "broken.json"), Columns()))

@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_parts_cover_every_record_once(tmp_path, fmt):
    records = [{"prompt": "x" * (i * 7 % 23), "response": f"r{i}", "history": []} for i in range(41)]
    path = tmp_path / "d.json"
    if fmt == "json":
        path.write_text(json.dumps(records, indent=1))
    else:
        _write(path, [json.dumps(r) for r in records])
    whole = [r[2] for r in read_records(str(path), Columns())]
    assert whole == [f"r{i}" for i in range(41)]
    for parts in (2, 3, 7, 50):
        joined = [r[2] for p in range(parts) for r in read_records(str(path), Columns(), part=p, parts=parts)]
        assert joined == whole, parts


# ---------------------------------------------------------------- metrics

def test_metrics_by_hand():
    assert units("我爱 北京, ok now") == ["我", "爱", "北", "京", ",", "ok", "now"]
    # identical but one unit short: all precisions 1, brevity penalty exp(1 - 5/4)
    assert bleu4(list("我爱北京"), list("我爱北京天")) == pytest.approx(math.exp(-0.25))
    # p1 = 2/3, p2 = 1/2, p3: no match -> 1/(2*1), p4: no 4-gram -> 1/4
    assert bleu4(["a", "b", "c"], ["a", "b", "d"]) == pytest.approx((2 / 3 * 1 / 2 * 1 / 2 * 1 / 4) ** 0.25)
    assert bleu4(["x"], ["y"]) == 0.0
    assert rouge_l(list("abcd"), list("abed")) == pytest.approx(0.75)
    assert rouge_l(list("ab"), list("abcd")) == pytest.approx(2 * 1 * 0.5 / 1.5)
    s = score(["您好", "再见。"], ["您好", "再见"])
    assert s["exact_match"] == 50.0 and s["samples"] == 2
    assert s["rouge-l"] == pytest.approx(100 * (1 + 2 * (2 / 3) * 1 / (2 / 3 + 1)) / 2)


# ---------------------------------------------------------------- sampler

def test_lazy_permutation_is_a_permutation():
    for n in list(range(1, 70)) + [257, 1000]:
        for seed in (0, 7):
            perm = [LazyPermutation(n, seed)(i) for i in range(n)]
            assert sorted(perm) == list(range(n)), (n, seed)
    a = [LazyPermutation(1000, 1)(i) for i in range(1000)]
    b = [LazyPermutation(1000, 2)(i) for i in range(1000)]
    assert a != b and a != list(range(1000))


@pytest.mark.parametrize("n,world,drop_last", [(10, 3, True), (10, 3, False), (2, 4, False), (64, 2, True)])
def test_shards_are_disjoint_equal_and_cover(n, world, drop_last):
    shards = [list(ShardSampler(n, num_replicas=world, rank=r, seed=3, drop_last=drop_last)) for r in range(world)]
    assert len({len(s) for s in shards}) == 1
    flat = [i for s in shards for i in s]
    if drop_last:
        assert len(flat) == len(set(flat)) == (n // world) * world
    else:
        assert set(flat) == set(range(n)) and len(flat) == -(-n // world) * world


def test_set_epoch_reshuffles_and_set_start_skips():
    s = ShardSampler(100, num_replicas=2, rank=1, seed=0, drop_last=True)
    first = list(s)
    s.set_epoch(1)
    second = list(s)
    assert first != second
    s.set_start(20)
    assert list(s) == second[20:] and len(s) == 30
    s.set_epoch(1)
    assert list(s) == second
