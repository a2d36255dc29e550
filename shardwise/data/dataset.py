"""A map-style dataset over a token cache, reading samples from memory-mapped files on demand.

Opening the dataset reads only ``index.json``; token files are mapped (not read) on first use
in each process, so a DataLoader worker or a forked process maps them itself and resident
memory holds only the pages that samples actually touched.
"""
from __future__ import annotations

import bisect
import json
import os

import numpy as np
import torch

from shardwise.data.chat import IGNORE_INDEX

__all__ = ["TokenizedChatDataset", "ChatCollator"]


def _map(path: str, dtype, count: int) -> np.ndarray:
    if count == 0:  # an empty file cannot be memory-mapped
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class TokenizedChatDataset(torch.utils.data.Dataset):
    """``dataset[i]`` is ``{"input_ids": LongTensor, "labels": LongTensor}`` of sample ``i``."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(os.path.join(path, "index.json")) as f:
            index = json.load(f)
        self.index = index
        self._dtype = np.dtype(index["token_dtype"])
        self._pieces = index["pieces"]
        self._starts = [0]
        for p in self._pieces:
            self._starts.append(self._starts[-1] + p["count"])
        self._maps: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __len__(self) -> int:
        return self._starts[-1]

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_maps"] = {}  # each process maps the files itself
        return state

    def _piece(self, k: int):
        if k not in self._maps:
            p, stem = self._pieces[k], os.path.join(self.path, self._pieces[k]["stem"])
            self._maps[k] = (_map(stem + ".tokens.bin", self._dtype, p["tokens"]),
                             _map(stem + ".offsets.bin", np.int64, p["count"] + 1),
                             _map(stem + ".source.bin", np.int32, p["count"]))
        return self._maps[k]

    def sample(self, i: int) -> tuple[np.ndarray, int]:
        """``(token ids, source length)`` of sample ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range (the dataset has {len(self)})")
        k = bisect.bisect_right(self._starts, i) - 1
        tokens, offsets, source = self._piece(k)
        j = i - self._starts[k]
        return tokens[offsets[j]:offsets[j + 1]], int(source[j])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        tokens, source_length = self.sample(i)
        ids = torch.from_numpy(tokens.astype(np.int64))
        labels = ids.clone()
        labels[:source_length] = IGNORE_INDEX
        return {"input_ids": ids, "labels": labels}


class ChatCollator:
    """Right-pads a list of samples into a batch with ``attention_mask``; padded labels are -100."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = int(pad_token_id)

    def __call__(self, samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), width), dtype=torch.long)
        for row, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[row, :n] = s["input_ids"]
            labels[row, :n] = s["labels"]
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
