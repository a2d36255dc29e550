"""Build a tiny causal LM folder locally (no downloads): a byte-level BPE tokenizer trained on
your data with the `tokenizers` library, and a small Llama with random weights.

    python examples/chat/make_tiny_model.py --data examples/chat/data/train.json --out tiny-model
    python examples/chat/make_tiny_model.py --data ... --out tiny-chat --chat_template

The folder loads with ``AutoTokenizer.from_pretrained`` / ``AutoModelForCausalLM.from_pretrained``.
Without ``--chat_template`` fine-tuning renders conversations with the round template; with it,
the tokenizer carries a small chat template (``<|user|>...<|assistant|>...</s>``).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Iterable, Iterator

SPECIAL = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{{ m['content'] }}</s>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Text the round template adds around every conversation; the tokenizer should know it.
ROUND_WORDS = ["[Round 1]\n\n问：", "\n\n答：", "[Round 2]", "[Round 3]", "[Round 4]", "[Round 5]"]


def texts_from_files(paths: Iterable[str]) -> Iterator[str]:
    """Every prompt, response and history string in JSON-lines / JSON-array chat files."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        records = json.loads(text) if text.lstrip().startswith("[") else \
            [json.loads(line) for line in text.splitlines() if line.strip()]
        for r in records:
            yield r.get("prompt", "")
            yield r.get("response", "")
            for pair in r.get("history") or []:
                yield from pair


def build_tokenizer(texts: Iterable[str], *, vocab_size: int = 1200, chat_template: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts) + ROUND_WORDS * 20, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=SPECIAL[3:])
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(tokenizer, *, hidden: int = 64, layers: int = 2, heads: int = 4, context: int = 512, seed: int = 0,
                init_std: float = 0.02):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=context, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=True, initializer_range=init_std)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def make_tiny_model(out_dir: str, texts: Iterable[str], *, chat_template: bool = False, hidden: int = 64,
                    layers: int = 2, heads: int = 4, vocab_size: int = 1200, seed: int = 0,
                    init_std: float = 0.02) -> str:
    tokenizer = build_tokenizer(texts, vocab_size=vocab_size, chat_template=chat_template)
    model = build_model(tokenizer, hidden=hidden, layers=layers, heads=heads, seed=seed, init_std=init_std)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", nargs="+", required=True, help="chat data files to train the tokenizer on")
    parser.add_argument("--out", required=True, help="model folder to write")
    parser.add_argument("--chat_template", action="store_true", help="give the tokenizer a chat template")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab_size", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init_std", type=float, default=0.02,
                        help="weight init scale; ~0.3 gives prompt-dependent babble, handy to test serving")
    args = parser.parse_args()
    make_tiny_model(args.out, texts_from_files(args.data), chat_template=args.chat_template, hidden=args.hidden,
                    layers=args.layers, heads=args.heads, vocab_size=args.vocab_size, seed=args.seed,
                    init_std=args.init_std)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
