"""A tiny local world for DeepSpeed-Chat (used by compat/run-deepspeed-chat.sh): an OPT model with random
weights, a byte-level BPE tokenizer trained here, and DS-Chat's ``local/jsonfile`` data. No hub.

    python compat/deepspeed_chat_prepare.py MODEL_DIR DSCHAT_DIR   (writes DSCHAT_DIR/data/{train,eval}.json)
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
THINGS = ["apple", "sky", "grass", "sun", "coal", "snow", "carrot", "plum", "car", "house", "door", "book"]


def samples(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        thing, colour, wrong = rng.choice(THINGS), rng.choice(COLOURS), rng.choice(COLOURS)
        out.append({"prompt": f"Human: What colour is the {thing}? Assistant:",
                    "chosen": f"The {thing} is {colour}, I think.",
                    "rejected": f"I do not know about {wrong} things."})
    return out


def tokenizer(texts: list[str], folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import GPT2TokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # OPT's ids for its special tokens: <s>=0, <pad>=1, </s>=2, <unk>=3
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(single="</s> $A", pair="</s> $A $B",
                                                       special_tokens=[("</s>", 2)])  # OPT prepends </s>
    fast = GPT2TokenizerFast(tokenizer_object=tok, bos_token="</s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")  # OPT's class (save_vocabulary works)
    fast.save_pretrained(folder)


def model(folder: Path, vocab: int) -> None:
    import torch
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    cfg = OPTConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
                    max_position_embeddings=256, word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2,
                    eos_token_id=2, dropout=0.0, attention_dropout=0.0)
    OPTForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)


def main(model_dir: str, chat_dir: str) -> None:
    data = Path(chat_dir) / "data"
    data.mkdir(parents=True, exist_ok=True)
    train, evaluation = samples(320, seed=0), samples(32, seed=1)
    (data / "train.json").write_text(json.dumps(train))
    (data / "eval.json").write_text(json.dumps(evaluation))
    folder = Path(model_dir)
    folder.mkdir(parents=True, exist_ok=True)
    texts = [f"{s['prompt']} {s['chosen']} {s['rejected']}<|endoftext|>" for s in train]
    tokenizer(texts, folder)
    from transformers import AutoTokenizer

    model(folder, vocab=8 * -(-len(AutoTokenizer.from_pretrained(folder)) // 8))


if __name__ == "__main__":
    main(*sys.argv[1:3])
