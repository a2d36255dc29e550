"""``--predict_with_generate``: answer every validation prompt and score the answers.

Each rank generates (greedy) for its share of the validation set and writes its answers to a
part file; rank 0 merges them in data-set order into ``generated_predictions.jsonl`` (one
``{"labels": reference, "predict": answer}`` per line) and writes the scores from
:mod:`shardwise.apps.metrics` to ``predict_results.json``. The reference is the tokenised
(and truncated) response decoded back to text, i.e. exactly what the model was taught.
"""
from __future__ import annotations

import json
import os

import torch

from shardwise import comm
from shardwise.apps.metrics import score
from shardwise.apps.trainer import even_shard
from shardwise.data import TokenizedChatDataset

__all__ = ["predict"]


@torch.no_grad()
def predict(engine, tokenizer, dataset: TokenizedChatDataset, *, output_dir: str, max_new_tokens: int,
            max_samples: int | None = None) -> dict | None:
    """Returns the scores on rank 0 (None elsewhere)."""
    module = engine.module
    module.eval()
    rank, world = engine.grid.get_data_parallel_rank(), engine.dp_world_size
    n = len(dataset) if max_samples is None else min(max_samples, len(dataset))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    part_path = os.path.join(output_dir, f".predictions.rank{rank}.jsonl")
    with open(part_path, "w", encoding="utf-8") as part:
        for i, real in even_shard(n, rank, world):
            tokens, source_length = dataset.sample(i)
            ids = torch.from_numpy(tokens[:source_length].astype("int64"))[None].to(engine.device)
            out = module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_id,
                                  use_cache=True, synced_gpus=world > 1)
            if real:
                answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
                reference = tokenizer.decode(tokens[source_length:].tolist(), skip_special_tokens=True)
                part.write(json.dumps({"index": i, "labels": reference, "predict": answer}, ensure_ascii=False) + "\n")
    module.train()
    comm.barrier()
    result = None
    if comm.get_rank() == 0:
        rows = []
        for r in range(world):
            path = os.path.join(output_dir, f".predictions.rank{r}.jsonl")
            with open(path, encoding="utf-8") as f:
                rows += [json.loads(line) for line in f]
            os.remove(path)
        rows.sort(key=lambda row: row["index"])
        with open(os.path.join(output_dir, "generated_predictions.jsonl"), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"labels": row["labels"], "predict": row["predict"]}, ensure_ascii=False) + "\n")
        result = score([r["predict"] for r in rows], [r["labels"] for r in rows])
        with open(os.path.join(output_dir, "predict_results.json"), "w") as f:
            json.dump(result, f, indent=1)
    comm.barrier()
    return result
