"""Chat data for fine-tuning: records -> rendered conversations -> a token cache read lazily.

>>> encoder = ChatEncoder(tokenizer, max_source_length=64, max_target_length=64)
>>> dataset, info = load_chat_dataset(["train.json"], encoder, cache_dir="out/.cache")
>>> sampler = ShardSampler(len(dataset), num_replicas=world, rank=rank, drop_last=True)
"""
from __future__ import annotations

from typing import Sequence

from shardwise.data.cache import CacheInfo, build_or_load_cache
from shardwise.data.chat import IGNORE_INDEX, ChatEncoder, history_to_messages, render_rounds
from shardwise.data.dataset import ChatCollator, TokenizedChatDataset
from shardwise.data.records import MAX_RECORD_BYTES, BadRecord, Columns
from shardwise.data.sampler import LazyPermutation, ShardSampler

__all__ = ["IGNORE_INDEX", "BadRecord", "CacheInfo", "ChatCollator", "ChatEncoder", "Columns",
           "LazyPermutation", "ShardSampler", "TokenizedChatDataset", "history_to_messages",
           "load_chat_dataset", "render_rounds"]


def load_chat_dataset(files: Sequence[str], encoder: ChatEncoder, *, cache_dir: str,
                      columns: Columns = Columns(), skip_bad_lines: bool = False,
                      workers: int = 1, max_record_bytes: int = MAX_RECORD_BYTES
                      ) -> tuple[TokenizedChatDataset, CacheInfo]:
    """Tokenise ``files`` into the cache under ``cache_dir`` (or reuse it) and open it.

    Call on every rank; see :func:`shardwise.data.cache.build_or_load_cache`.
    """
    info = build_or_load_cache(files, encoder, cache_dir, columns=columns, skip_bad_lines=skip_bad_lines,
                               workers=workers, max_record_bytes=max_record_bytes)
    return TokenizedChatDataset(info.path), info
