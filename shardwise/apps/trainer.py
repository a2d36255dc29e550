"""The fine-tuning loop, written only against the engine's public API.

Nothing here knows the ZeRO stage: forward is ``engine(**batch)``, then ``engine.backward`` and
``engine.step``; checkpoints are ``engine.save_checkpoint`` / ``engine.load_checkpoint``. Every
rank runs the same number of forward passes in evaluation and prediction (short shards are
padded with a dummy sample that is not counted), because partitioned stages gather parameters
with collectives inside forward.
"""
from __future__ import annotations

import json
import logging
import math
import os
from typing import Iterator

import torch
import torch.nn.functional as F

from shardwise import comm
from shardwise.data import IGNORE_INDEX, ChatCollator, ShardSampler, TokenizedChatDataset

logger = logging.getLogger("shardwise")

CHECKPOINT_SUBDIR = "checkpoints"

__all__ = ["Trainer", "even_shard", "resolve_checkpoint"]


def even_shard(n: int, rank: int, world: int) -> Iterator[tuple[int, bool]]:
    """``(index, real)`` for this rank's share of ``range(n)``, the same length on every rank."""
    for j in range(-(-n // world)):
        i = rank + j * world
        yield (i, True) if i < n else (0, False)


def resolve_checkpoint(spec: str, output_dir: str) -> tuple[str, str | None]:
    """``--resume_from_checkpoint`` value -> ``(load_dir, tag)`` for ``engine.load_checkpoint``."""
    if spec == "auto":
        spec = os.path.join(output_dir, CHECKPOINT_SUBDIR)
    if os.path.isfile(os.path.join(spec, "manifest.json")):  # one tag's folder
        return os.path.dirname(os.path.abspath(spec)), os.path.basename(os.path.abspath(spec))
    if os.path.isfile(os.path.join(spec, "latest")):
        return spec, None
    raise ValueError(f"--resume_from_checkpoint: {spec} is neither a checkpoint folder with a 'latest' file "
                     "nor one checkpoint tag (a folder with manifest.json)")


class Trainer:
    def __init__(self, engine, args, *, train_set: TokenizedChatDataset, eval_set: TokenizedChatDataset | None,
                 collator: ChatCollator, total_steps: int) -> None:
        self.engine = engine
        self.args = args
        self.train_set, self.eval_set, self.collator = train_set, eval_set, collator
        self.total_steps = total_steps
        self.rank, self.world = engine.grid.get_data_parallel_rank(), engine.dp_world_size
        self.micro_batch = engine.train_micro_batch_size_per_gpu()
        self.sampler = ShardSampler(len(train_set), num_replicas=self.world, rank=self.rank, shuffle=True,
                                    seed=args.seed, drop_last=True)
        if self.sampler.per_rank == 0:
            raise ValueError(f"{args.train_file} (--train_file) has {len(train_set)} usable samples, fewer than "
                             f"the {self.world} "
                             "data-parallel processes")
        self.loader = torch.utils.data.DataLoader(train_set, batch_size=self.micro_batch, sampler=self.sampler,
                                                  collate_fn=collator, num_workers=args.dataloader_num_workers)
        self.batches_per_epoch = math.ceil(self.sampler.per_rank / self.micro_batch)
        self.epoch = 0
        self.batches_in_epoch = 0
        self._interval: list[float] = []
        self.last_eval: tuple[int, float] | None = None  # (step, loss) of the latest evaluation
        self.log_path = os.path.join(args.output_dir, "trainer_log.jsonl")

    # -- logging -------------------------------------------------------------------------------
    def log(self, record: dict) -> None:
        if comm.get_rank() != 0:
            return
        line = json.dumps(record, ensure_ascii=False)
        print(line, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def _mean_over_ranks(self, values: list[float]) -> float:
        t = torch.tensor([sum(values), float(len(values))], dtype=torch.float64)
        if comm.get_world_size() > 1:
            comm.all_reduce(t)
        return float(t[0] / t[1]) if t[1] else float("nan")

    # -- training ------------------------------------------------------------------------------
    def train(self) -> None:
        engine = self.engine
        engine.module.train()
        with engine.progress(total=self.total_steps, desc="finetune"):
            while engine.global_steps < self.total_steps:
                for batch in self.loader:
                    out = engine(**{k: v.to(engine.device) for k, v in batch.items()})
                    engine.backward(out.loss)
                    before = engine.global_steps
                    engine.step()
                    self.batches_in_epoch += 1
                    if engine.global_steps != before:
                        self._after_step()
                        if engine.global_steps >= self.total_steps:
                            return
                self.epoch += 1
                self.batches_in_epoch = 0
                self.sampler.set_epoch(self.epoch)

    def _after_step(self) -> None:
        engine, args, step = self.engine, self.args, self.engine.global_steps
        loss = engine.get_loss()
        if loss is not None:
            self._interval.append(loss)
        if step % args.logging_steps == 0 or step == self.total_steps:
            self.log({"step": step, "epoch": round(self.epoch + self.batches_in_epoch / self.batches_per_epoch, 4),
                      "loss": round(self._mean_over_ranks(self._interval), 6), "lr": engine.get_lr()[0],
                      "grad_norm": engine.get_global_grad_norm(), "skipped_steps": engine.skipped_steps})
            self._interval = []
        if args.eval_steps and self.eval_set is not None and step % args.eval_steps == 0:
            self.log({"step": step, "eval_loss": round(self.evaluate(), 6)})
        if args.save_steps and step % args.save_steps == 0:
            self.save_checkpoint()

    # -- evaluation ------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss per response token over the whole validation set (every rank gets the value)."""
        assert self.eval_set is not None
        engine, module = self.engine, self.engine.module
        module.eval()
        bs = self.args.per_device_eval_batch_size or self.micro_batch
        shard = list(even_shard(len(self.eval_set), self.rank, self.world))
        totals = torch.zeros(2, dtype=torch.float64)
        for start in range(0, len(shard), bs):
            part = shard[start:start + bs]
            batch = self.collator([self.eval_set[i] for i, _ in part])
            real = torch.tensor([r for _, r in part])
            logits = engine(input_ids=batch["input_ids"].to(engine.device),
                            attention_mask=batch["attention_mask"].to(engine.device)).logits
            target = batch["labels"][:, 1:].to(logits.device)
            ce = F.cross_entropy(logits[:, :-1].float().transpose(1, 2), target, ignore_index=IGNORE_INDEX,
                                 reduction="none")
            mask = (target != IGNORE_INDEX) & real[:, None].to(logits.device)
            totals += torch.stack([(ce * mask).sum(), mask.sum()]).double().cpu()
        if comm.get_world_size() > 1:
            comm.all_reduce(totals)
        module.train()
        loss = float(totals[0] / totals[1]) if totals[1] else float("nan")
        self.last_eval = (engine.global_steps, loss)
        return loss

    # -- checkpoints ---------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        where = os.path.join(self.args.output_dir, CHECKPOINT_SUBDIR)
        self.engine.save_checkpoint(where, client_state={
            "epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch, "seed": self.args.seed,
            "world_size": self.world, "micro_batch": self.micro_batch})
        self.log({"step": self.engine.global_steps, "checkpoint": os.path.join(where, f"global_step{self.engine.global_steps}")})

    def resume(self, spec: str) -> None:
        load_dir, tag = resolve_checkpoint(spec, self.args.output_dir)
        path, state = self.engine.load_checkpoint(load_dir, tag=tag)
        if path is None:
            raise ValueError(f"--resume_from_checkpoint: no checkpoint found in {load_dir}")
        same = state.get("world_size") == self.world and state.get("micro_batch") == self.micro_batch \
            and state.get("seed") == self.args.seed
        self.epoch = int(state.get("epoch", 0))
        self.sampler.set_epoch(self.epoch)
        if same:
            self.batches_in_epoch = int(state.get("batches_in_epoch", 0))
            self.sampler.set_start(min(self.batches_in_epoch * self.micro_batch, self.sampler.per_rank))
        elif comm.get_rank() == 0:
            logger.warning("resuming with a different world size, micro-batch or seed than the checkpoint's: "
                           "the data order restarts at the beginning of epoch %d", self.epoch)
        self.log({"step": self.engine.global_steps, "resumed_from": path})
