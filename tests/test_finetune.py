"""Fine-tuning end to end on a synthetic data set and a tiny model built locally. The main run
goes through the real launcher (`shardwise run --num_procs 2 -m shardwise.apps.finetune ...`);
the variants run the same entry point in one 2-rank harness group to save start-up time.

* the main run (ZeRO stage 2): loss falls, checkpoints at --save_steps, eval loss, predictions
  and scores, a `from_pretrained`-loadable output that `shardwise serve` answers from;
* every other ZeRO stage the config accepts logs the same losses as stage 2;
* resuming from the step-15 checkpoint ends with the same weights as the uninterrupted run;
* a LoRA run saves an adapter and a merged model, both loadable by transformers/peft and the server;
* `shardwise finetune` in one process: fp16 + gradient checkpointing + chat template;
* user mistakes stop with exit code 2 and a message naming the file/line or flag.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples", "chat"))

from distributed import run_distributed, run_subtests  # noqa: E402
from make_synthetic_data import make  # noqa: E402
from make_tiny_model import make_tiny_model, texts_from_files  # noqa: E402
from test_serve import running_server  # noqa: E402

MAIN_STAGE = 2
STEPS = 30


def accepted_stages() -> list[int]:
    from shardwise.config import load_config

    ok = []
    for stage in (0, 1, 2, 3):
        try:
            load_config({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}}).check_supported()
            ok.append(stage)
        except ValueError:
            pass
    return ok


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    train, dev = make(str(root / "data"), dialogues=100, dev_dialogues=4, seed=2)
    texts = list(texts_from_files([train]))
    model = make_tiny_model(str(root / "model"), texts, vocab_size=600, seed=1)
    chat_model = make_tiny_model(str(root / "chat-model"), texts, vocab_size=600, seed=1, chat_template=True)
    base = json.load(open(os.path.join(ROOT, "examples", "chat", "ds_config.json")))
    for stage in (0, 1, 2, 3):
        cfg = dict(base, zero_optimization={**base["zero_optimization"], "stage": stage})
        (root / f"ds{stage}.json").write_text(json.dumps(cfg))
    return {"root": root, "train": train, "dev": dev, "model": model, "chat_model": chat_model}


def common_flags(ws, out, stage):
    return ["--deepspeed", str(ws["root"] / f"ds{stage}.json"), "--train_file", ws["train"],
            "--prompt_column", "prompt", "--response_column", "response", "--history_column", "history",
            "--model_name_or_path", ws["model"], "--output_dir", str(out), "--max_source_length", "96",
            "--max_target_length", "32", "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
            "--max_steps", str(STEPS), "--logging_steps", "5", "--learning_rate", "3e-3", "--warmup_steps", "2",
            "--data_cache_dir", str(ws["root"] / "cache")]


def launch(ws, args, *, procs=2, expect=0):
    if procs:
        cmd = [sys.executable, "-m", "shardwise", "run", "--num_procs", str(procs), "-m", "shardwise.apps.finetune"]
    else:
        cmd = [sys.executable, "-m", "shardwise", "finetune"]
    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300, cwd=ws["root"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect, out[-4000:]
    return out


def log_records(out_dir):
    with open(os.path.join(out_dir, "trainer_log.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(out_dir):
    return {r["step"]: r["loss"] for r in log_records(out_dir) if "loss" in r}


def load_weights(folder):
    from safetensors.torch import load_file

    return load_file(os.path.join(folder, "model.safetensors"))


@pytest.fixture(scope="module")
def trained(ws):
    out = ws["root"] / "out"
    launch(ws, common_flags(ws, out, MAIN_STAGE) + [
        "--validation_file", ws["dev"], "--save_steps", "15", "--eval_steps", "15", "--predict_with_generate",
        "--max_predict_samples", "6"])
    return out


def test_main_run_trains_saves_evaluates_and_predicts(ws, trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    records = log_records(trained)
    assert records[0]["world_size"] == 2 and records[0]["template"] == "round" and records[0]["train_samples"] > 400
    by_step = losses(trained)
    assert sorted(by_step) == list(range(5, STEPS + 1, 5))
    assert by_step[STEPS] < 0.75 * by_step[5], by_step
    evals = [r["eval_loss"] for r in records if "eval_loss" in r and "done" not in r]
    assert len(evals) == 2 and evals[1] < evals[0]
    assert (trained / "checkpoints" / "latest").read_text() == f"global_step{STEPS}"
    assert (trained / "checkpoints" / "global_step15" / "manifest.json").is_file()

    model = AutoModelForCausalLM.from_pretrained(str(trained))
    AutoTokenizer.from_pretrained(str(trained))
    initial = AutoModelForCausalLM.from_pretrained(ws["model"]).state_dict()
    assert any(not torch.equal(t, initial[n]) for n, t in model.state_dict().items())

    rows = [json.loads(line) for line in open(trained / "generated_predictions.jsonl", encoding="utf-8")]
    assert len(rows) == 6 and all(set(r) == {"labels", "predict"} for r in rows)
    dev_responses = [json.loads(line)["response"] for line in open(ws["dev"], encoding="utf-8")][:6]
    assert [r["labels"] for r in rows] == dev_responses
    scores = json.load(open(trained / "predict_results.json"))
    assert scores["samples"] == 6 and set(scores) >= {"exact_match", "bleu-4", "rouge-l"}


def _variant(case, rank, world, ws, trained):
    """One fine-tuning run inside the harness's process group (imports paid once for all cases)."""
    from shardwise.apps.finetune import build_parser, run

    kind, stage = case
    flags = common_flags(ws, ws["root"] / f"{kind}{stage}", stage) + ["--save_steps", "0"]
    if kind == "resume":
        flags += ["--resume_from_checkpoint", str(trained / "checkpoints" / "global_step15")]
    if kind == "lora":
        flags += ["--max_steps", "6", "--lora_r", "4", "--lora_target_modules", "q_proj,v_proj", "--bf16",
                  "--merge_lora"]
    run(build_parser().parse_args(flags))


def _variants_body(rank, world, cases, ws, trained):
    run_subtests(_variant, cases, rank, world, ws, trained)


OTHER_STAGES = [s for s in accepted_stages() if s != MAIN_STAGE]


@pytest.fixture(scope="module")
def variants(ws, trained):
    """Other ZeRO stages, a resumed run and a LoRA run, at 2 ranks in one spawned group."""
    cases = [("stage", s) for s in OTHER_STAGES] + [("resume", MAIN_STAGE), ("lora", 0)]
    run_distributed(_variants_body, 2, args=(cases, ws, trained), timeout=400)
    return ws["root"]


@pytest.mark.parametrize("stage", OTHER_STAGES)
def test_other_zero_stages_log_the_same_losses(variants, trained, stage):
    out = variants / f"stage{stage}"
    ours, main = losses(out), losses(trained)
    assert ours.keys() == main.keys()
    for step in main:
        assert ours[step] == pytest.approx(main[step], rel=1e-4), (step, ours, main)
    final, reference = load_weights(out), load_weights(trained)
    for name, t in reference.items():
        torch.testing.assert_close(final[name], t, rtol=1e-4, atol=1e-5)


def test_resume_from_a_checkpoint_ends_where_the_full_run_did(variants, trained):
    out = variants / f"resume{MAIN_STAGE}"
    records = log_records(out)
    assert any(r.get("resumed_from", "").endswith("global_step15") for r in records)
    assert min(losses(out)) == 20
    assert losses(out)[STEPS] == losses(trained)[STEPS]
    final, reference = load_weights(out), load_weights(trained)
    assert final.keys() == reference.keys()
    for name in reference:
        assert torch.equal(final[name], reference[name]), name


def test_lora_adapter_and_merged_model_are_saved_and_served(ws, variants):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from shardwise.apps.generation import ChatModel, GenerationLimits

    out = variants / "lora0"
    records = log_records(out)
    base = AutoModelForCausalLM.from_pretrained(ws["model"])
    total = sum(p.numel() for p in base.parameters())
    assert records[0]["world_size"] == 2 and 0 < records[0]["trainable_parameters"] < total / 10
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert adapter and all("lora_" in k for k in adapter)
    assert any(k.endswith("lora_B.weight") and t.abs().sum() > 0 for k, t in adapter.items())  # B starts at 0
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ws["model"]), str(out / "adapter"))

    merged = AutoModelForCausalLM.from_pretrained(str(out)).state_dict()
    for name, t in base.state_dict().items():
        adapted = name.endswith(("q_proj.weight", "v_proj.weight"))
        assert torch.equal(merged[name], t) != adapted, name

    for folder in (out / "adapter", out):
        chat = ChatModel.load(str(folder))
        answer = chat.generate(chat.prompt_ids([{"role": "user", "content": "是。"}]),
                               GenerationLimits(max_new_tokens=5, temperature=0.0, top_p=1.0))
        assert answer.completion_tokens >= 1

    # the adapter as written, served per request over the base model, scores as the merged model does
    from shardwise.apps.batching import BatchedGenerator

    base_chat, merged_chat = ChatModel.load(ws["model"]), ChatModel.load(str(out))
    ids = merged_chat.prompt_ids([{"role": "user", "content": "是。"}]) + [5, 9, 14]
    engine = BatchedGenerator(base_chat, adapters={"ft": str(out / "adapter")})
    try:
        served = [t.logprob for t in engine.score(ids, adapter="ft").result(60)[1:]]
        plain = [t.logprob for t in engine.score(ids).result(60)[1:]]
    finally:
        engine.close()
    with torch.no_grad():
        lp = torch.log_softmax(merged_chat.model(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
    expected = lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
    assert served == pytest.approx(expected, abs=1e-4)
    assert plain != pytest.approx(expected, abs=1e-4)  # the adapter is what makes the difference


def test_trained_folder_is_served(trained, tmp_path):
    with running_server(str(trained), "--max_new_tokens", "16", log_path=str(tmp_path / "serve.log")) as url:
        assert httpx.get(url + "/health", timeout=10).json()["template"] == "round"
        history = [["", "您好，请问是马女士吗？"]]
        r = httpx.post(url, json={"prompt": "是。\n[姓名]:马芳\n[年龄]:52.0\n[性别]:女士\n[省份]:河南",
                                  "history": history}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["status"] == 200 and isinstance(body["response"], str) and body["response"]
        assert body["history"][:1] == history and body["history"][1][1] == body["response"]


def test_one_process_fp16_gradient_checkpointing_chat_template(ws, tmp_path):
    from safetensors import safe_open

    cfg = json.load(open(ws["root"] / "ds0.json"))
    cfg["fp16"] = {"enabled": "auto", "initial_scale_power": 8}
    (tmp_path / "fp16.json").write_text(json.dumps(cfg))
    lines = open(ws["train"], encoding="utf-8").read().splitlines()[:41]
    lines[7] = '{"prompt": "x", "response": ["not", "a", "string"]}'  # 40 good samples remain
    (tmp_path / "train.json").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    launch(ws, ["--deepspeed", str(tmp_path / "fp16.json"), "--train_file", str(tmp_path / "train.json"),
                "--history_column", "history", "--model_name_or_path", ws["chat_model"], "--output_dir", str(out),
                "--max_source_length", "64", "--max_target_length", "24", "--per_device_train_batch_size", "4",
                "--num_train_epochs", "2", "--logging_steps", "5", "--save_steps", "0", "--learning_rate", "3e-3",
                "--fp16", "--gradient_checkpointing", "--skip_bad_lines", "--data_cache_dir", str(tmp_path / "c")],
           procs=0)
    records = log_records(out)
    assert records[0]["template"] == "chat" and records[0]["world_size"] == 1 and records[0]["skipped_records"] == 1
    by_step = losses(out)
    assert sorted(by_step) == [5, 10, 15, 20]  # 2 epochs of 40 samples / 4 per step
    assert all(v == v for v in by_step.values()) and by_step[20] < by_step[5]
    assert [r["epoch"] for r in records if "loss" in r] == [0.5, 1.0, 1.5, 2.0]
    assert records[-1]["done"] and records[-1]["step"] == 20
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float16  # trained in fp16


def test_user_mistakes_exit_2_with_a_message(ws, tmp_path):
    lines = open(ws["train"], encoding="utf-8").read().splitlines()[:30]
    lines[2] = '{"prompt": "x", "respons": "typo"}'
    (tmp_path / "train.json").write_text("\n".join(lines) + "\n", encoding="utf-8")
    base = ["--model_name_or_path", ws["model"], "--output_dir", str(tmp_path / "o"), "--max_steps", "2",
            "--data_cache_dir", str(tmp_path / "c")]
    out = launch(ws, base + ["--train_file", str(tmp_path / "train.json")], procs=0, expect=2)
    assert "train.json:3: no 'response' key" in out and "did you mean 'respons'" in out
    assert "--skip_bad_lines" in out and "Traceback" not in out
    cfg = json.load(open(ws["root"] / "ds0.json"))
    cfg["train_micro_batch_size_per_gpu"] = 8
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    out = launch(ws, base + ["--train_file", ws["train"], "--deepspeed", str(tmp_path / "ds.json"),
                             "--per_device_train_batch_size", "4"], procs=0, expect=2)
    assert (f"train_micro_batch_size_per_gpu is 8 in the config {tmp_path / 'ds.json'} (--deepspeed) but "
            "--per_device_train_batch_size is 4") in out

    # Issue 30 item 8: a learning-rate mistake names the config file; empty data names the data file.
    cfg = json.load(open(ws["root"] / "ds0.json"))
    cfg.setdefault("optimizer", {"type": "AdamW", "params": {}})["params"]["lr"] = "fast"
    (tmp_path / "ds_lr.json").write_text(json.dumps(cfg))
    out = launch(ws, base + ["--train_file", ws["train"], "--deepspeed", str(tmp_path / "ds_lr.json")],
                 procs=0, expect=2)
    assert f"optimizer.params.lr in the config {tmp_path / 'ds_lr.json'} (--deepspeed) must be a number" in out, out
    (tmp_path / "empty.json").write_text("\n\n")
    out = launch(ws, base + ["--train_file", str(tmp_path / "empty.json")], procs=0, expect=2)
    assert f"{tmp_path / 'empty.json'} (--train_file) has no usable samples: it holds no records" in out, out
    assert "Traceback" not in out
