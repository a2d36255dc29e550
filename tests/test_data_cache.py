"""The token cache: built once, reused, invalidated by any input change, built in parallel by ranks."""
from __future__ import annotations

import glob
import json
import os
import pickle
import sys

import numpy as np
import pytest

from distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "chat"))

from make_synthetic_data import make  # noqa: E402
from make_tiny_model import build_tokenizer, texts_from_files  # noqa: E402

from shardwise.data import ChatEncoder, Columns, ShardSampler, TokenizedChatDataset, load_chat_dataset  # noqa: E402
from shardwise.data.records import read_records  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    train, dev = make(str(root / "data"), dialogues=60, dev_dialogues=5, seed=1)
    tok = build_tokenizer(texts_from_files([train]), vocab_size=500)
    tok.save_pretrained(str(root / "tok"))
    return root, train, dev, tok


def _expected(path, encoder, columns=Columns()):
    samples = [(m, r) for _, m, r in read_records(path, columns)]
    return [(e.input_ids, e.source_length) for e in encoder.encode_batch(samples)]


def _contents(ds):
    return [(ds.sample(i)[0].tolist(), ds.sample(i)[1]) for i in range(len(ds))]


def test_cache_holds_the_encoder_output_and_is_reused(setup, tmp_path):
    root, train, _, tok = setup
    enc = ChatEncoder(tok, max_source_length=96, max_target_length=32)
    ds, info = load_chat_dataset([train], enc, cache_dir=str(tmp_path))
    assert not info.reused and info.num_samples == len(ds) > 200
    assert _contents(ds) == _expected(train, enc)
    item = ds[3]
    src = ds.sample(3)[1]
    assert (item["labels"][:src] == -100).all() and (item["labels"][src:] == item["input_ids"][src:]).all()
    stamps = {f: os.stat(f).st_mtime_ns for f in glob.glob(os.path.join(info.path, "*"))}

    ds2, info2 = load_chat_dataset([train], ChatEncoder(tok, max_source_length=96, max_target_length=32),
                                   cache_dir=str(tmp_path))
    assert info2.reused and info2.path == info.path
    assert {f: os.stat(f).st_mtime_ns for f in glob.glob(os.path.join(info.path, "*"))} == stamps
    assert _contents(ds2) == _contents(ds)
    # The dataset holds no samples in memory: it pickles to a few hundred bytes and maps files.
    assert len(pickle.dumps(ds2)) < 4096
    assert isinstance(ds2._piece(0)[0], np.memmap)


def test_any_input_change_builds_a_new_entry(setup, tmp_path):
    root, train, _, tok = setup
    base = ChatEncoder(tok, max_source_length=96, max_target_length=32)
    _, info = load_chat_dataset([train], base, cache_dir=str(tmp_path))
    changed = tmp_path / "train.json"
    changed.write_text(open(train, encoding="utf-8").read(), encoding="utf-8")
    _, same_content = load_chat_dataset([str(changed)], base, cache_dir=str(tmp_path))
    assert same_content.reused  # keyed by content, not by path
    with open(changed, "a", encoding="utf-8") as f:
        f.write(json.dumps({"prompt": "新的", "response": "一条", "history": []}, ensure_ascii=False) + "\n")
    ds, new = load_chat_dataset([str(changed)], base, cache_dir=str(tmp_path))
    assert not new.reused and new.path != info.path and new.num_samples == info.num_samples + 1
    assert ds.sample(len(ds) - 1)[0][-1] == tok.eos_token_id
    variants = [ChatEncoder(tok, max_source_length=64, max_target_length=32),
                ChatEncoder(build_tokenizer(texts_from_files([train]), vocab_size=500, chat_template=True),
                            max_source_length=96, max_target_length=32)]
    paths = {info.path}
    for enc in variants:
        _, i = load_chat_dataset([train], enc, cache_dir=str(tmp_path))
        assert not i.reused
        paths.add(i.path)
    _, i = load_chat_dataset([train], base, cache_dir=str(tmp_path), columns=Columns(history=None))
    assert not i.reused
    assert len(paths | {i.path}) == 4


def test_bad_lines_fail_or_are_skipped_and_counted(setup, tmp_path):
    root, train, _, tok = setup
    lines = open(train, encoding="utf-8").read().splitlines()[:20]
    lines[4] = '{"prompt": "x"}'
    lines[11] = "garbage"
    path = tmp_path / "bad.json"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    enc = ChatEncoder(tok, max_source_length=96, max_target_length=32)
    with pytest.raises(ValueError, match=r"bad.json:5: no 'response' key.*--skip_bad_lines"):
        load_chat_dataset([str(path)], enc, cache_dir=str(tmp_path / "c"))
    assert os.listdir(tmp_path / "c") == []  # nothing half-built left behind
    (tmp_path / "array.json").write_text('[{"prompt": "a", "response": "b"} {"prompt": "c"}]')
    with pytest.raises(ValueError, match=r"array.json:1 \(after element 0\): not a valid JSON array") as err:
        load_chat_dataset([str(tmp_path / "array.json")], enc, cache_dir=str(tmp_path / "c"), skip_bad_lines=True)
    assert "--skip_bad_lines" not in str(err.value)  # a broken array cannot be skipped around
    ds, info = load_chat_dataset([str(path)], enc, cache_dir=str(tmp_path / "c"), skip_bad_lines=True)
    assert len(ds) == 18 and info.skipped == 2
    assert info.bad_examples[0].startswith("bad.json:5:") and info.bad_examples[1].startswith("bad.json:12:")


def _two_rank_body(rank, world, root, train, cache, bad):
    from transformers import AutoTokenizer

    from shardwise.data import ChatEncoder, ShardSampler, load_chat_dataset

    enc = ChatEncoder(AutoTokenizer.from_pretrained(os.path.join(root, "tok")), max_source_length=96,
                      max_target_length=32)
    ds, info = load_chat_dataset([train], enc, cache_dir=cache, workers=2)
    shard = list(ShardSampler(len(ds), num_replicas=world, rank=rank, seed=5, drop_last=True))
    again = load_chat_dataset([train], enc, cache_dir=cache)[1].reused
    try:
        load_chat_dataset([bad], enc, cache_dir=cache)
        error = None
    except ValueError as exc:
        error = str(exc)
    return {"path": info.path, "reused": info.reused, "again": again, "pieces": len(ds.index["pieces"]),
            "contents": _contents(ds), "shard": shard, "error": error}


def test_two_ranks_build_in_parallel_and_read_disjoint_shards(setup, tmp_path):
    root, train, _, tok = setup
    lines = open(train, encoding="utf-8").read().splitlines()
    lines[-3] = '{"prompt": 1, "response": "r"}'  # in the last quarter: found by rank 1's pieces
    bad = tmp_path / "bad.json"
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    results = run_distributed(_two_rank_body, 2, args=(str(root), train, str(tmp_path / "c"), str(bad)),
                              timeout=120)
    r0, r1 = results
    assert r0["path"] == r1["path"] and not r0["reused"] and r0["again"] and r1["again"]
    assert r0["pieces"] == 4  # 2 ranks x 2 pieces each (built in turn: harness ranks cannot fork workers)
    single = ChatEncoder(tok, max_source_length=96, max_target_length=32)
    assert r0["contents"] == r1["contents"] == _expected(train, single)
    n = len(r0["contents"])
    assert not set(r0["shard"]) & set(r1["shard"])
    assert len(r0["shard"]) == len(r1["shard"]) == n // 2
    assert len(set(r0["shard"]) | set(r1["shard"])) == n - n % 2
    line = len(lines) - 2
    assert r0["error"] == r1["error"]
    assert r0["error"].startswith(f"bad.json:{line}: 'prompt' must be a string")
    assert not glob.glob(str(tmp_path / "c" / ".tmp-*"))


def test_tokenising_workers_give_the_same_cache(setup, tmp_path):
    root, train, _, tok = setup
    enc = ChatEncoder(tok, max_source_length=96, max_target_length=32)
    ds, info = load_chat_dataset([train], enc, cache_dir=str(tmp_path), workers=3)
    assert len(ds.index["pieces"]) == 3 and all(p["count"] > 0 for p in ds.index["pieces"])
    assert _contents(ds) == _expected(train, enc)


def test_dataset_reads_only_what_it_is_asked_for(setup, tmp_path):
    root, train, _, tok = setup
    ds, _ = load_chat_dataset([train], ChatEncoder(tok, max_source_length=96, max_target_length=32),
                              cache_dir=str(tmp_path))
    fresh = TokenizedChatDataset(ds.path)
    assert fresh._maps == {}  # opening reads the index only
    sampler = ShardSampler(len(fresh), num_replicas=4, rank=2, seed=0, drop_last=True)
    for i in sampler:
        assert fresh[i]["input_ids"].tolist() == ds.sample(i)[0].tolist()


@pytest.mark.parametrize("kind", ["json", "jsonl"])
def test_non_utf8_byte_is_named_with_file_and_line(tmp_path, kind):
    """A non-UTF-8 byte is named with file and line, not only "'utf-8' codec can't decode byte 0xe9"."""
    from shardwise.data.records import BadRecord, Columns, read_records

    good = '{"prompt": "a", "response": "b"}'
    bad = '{"prompt": "caf\xe9", "response": "b"}'.encode("latin-1")
    if kind == "json":
        raw = b"[\n" + good.encode() + b",\n" + good.encode() + b",\n" + bad + b"\n]\n"
    else:
        raw = good.encode() + b"\n" + good.encode() + b"\n" + bad + b"\n"
    path = tmp_path / f"train.{kind}"
    path.write_bytes(raw)
    with pytest.raises(BadRecord) as info:
        for item in read_records(str(path), Columns()):
            if isinstance(item, BadRecord):
                raise item
    message = str(info.value)
    assert message.startswith(f"train.{kind}:{4 if kind == 'json' else 3}: "), message
    assert "not UTF-8" in message and "0xe9" in message, message
