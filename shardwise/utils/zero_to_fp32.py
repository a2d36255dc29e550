#!/usr/bin/env python
"""Consolidate a shardwise checkpoint into one fp32 state dict (``deepspeed.utils.zero_to_fp32``).

This file is both the module ``shardwise.utils.zero_to_fp32`` (DeepSpeed's functions and
arguments) and a stand-alone script: ``save_checkpoint`` copies it into the save folder, where

    python zero_to_fp32.py <save folder> <output folder> [--safe_serialization] [-t TAG]

rebuilds the model's fp32 weights on a machine with only torch and safetensors installed.
So it imports nothing from shardwise. It reads the checkpoint's ``manifest.json``: trained
parameters are assembled from the fp32 master fragments every rank wrote (whatever the world
size and ZeRO stage), everything else (buffers, frozen parameters) comes from
``model.safetensors``, floating tensors cast to fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import OrderedDict

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def _parse_size(size) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]i?)?B?\s*", str(size), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a size like '500MB', '5GB' or '2GiB'")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def _checkpoint_folder(checkpoint_dir, tag) -> str:
    """The tag's folder: ``tag``, else the one named in ``checkpoint_dir/latest``; or
    ``checkpoint_dir`` itself when it holds a manifest."""
    if tag is None and os.path.isfile(os.path.join(checkpoint_dir, "manifest.json")):
        return checkpoint_dir
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise ValueError(f"Unable to find 'latest' file at {latest}: pass tag=")
        with open(latest) as f:
            tag = f.read().strip()
    folder = os.path.join(checkpoint_dir, str(tag))
    if not os.path.isfile(os.path.join(folder, "manifest.json")):
        raise FileNotFoundError(f"{folder} is not a shardwise checkpoint (no manifest.json there)")
    return folder


class _LazyTensor:
    """One tensor of the checkpoint, read when ``.contiguous()`` is called (``lazy_mode=True``)."""

    def __init__(self, folder: str, entry: dict, source: str, shape: list[int], dtype: torch.dtype) -> None:
        self._folder, self._entry, self._source = folder, entry, source
        self.shape, self.dtype = torch.Size(shape), dtype

    def numel(self) -> int:
        return self.shape.numel()

    def contiguous(self) -> torch.Tensor:
        if self._entry is None:  # not trained: the module's own tensor
            with safe_open(os.path.join(self._folder, "model.safetensors"), framework="pt") as fh:
                t = fh.get_tensor(self._source)
            return t.to(self.dtype)
        numel, out, covered = self.numel(), None, 0
        for frag in self._entry["fragments"]:
            with safe_open(os.path.join(self._folder, frag["file"]), framework="pt") as fh:
                piece = fh.get_tensor(frag["key"]).reshape(-1)
            if out is None:
                out = torch.empty(numel, dtype=torch.float32)
            out[frag["start"]:frag["end"]] = piece
            covered += frag["end"] - frag["start"]
        if covered != numel:
            raise ValueError(f"checkpoint {self._folder} holds {covered} of the {numel} elements of {self._source}")
        return (out if out is not None else torch.empty(0)).view(self.shape)


def _lazy_state_dict(folder: str, exclude_frozen_parameters: bool) -> "OrderedDict[str, _LazyTensor]":
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    tensors = manifest["tensors"]
    masters, model = tensors.get("master", {}), tensors["model"]
    aliases = manifest.get("aliases", {})
    frozen = set(manifest.get("frozen", [])) if exclude_frozen_parameters else set()
    order = manifest.get("module_keys") or sorted(set(model) | set(aliases))
    out: OrderedDict[str, _LazyTensor] = OrderedDict()
    by_source: dict[str, _LazyTensor] = {}
    for name in order:
        source = aliases.get(name, name)
        if source in frozen:
            continue
        if source not in by_source:
            if source in masters:
                by_source[source] = _LazyTensor(folder, masters[source], source, masters[source]["shape"], torch.float32)
            elif source in model:
                dtype = getattr(torch, model[source]["dtype"])
                by_source[source] = _LazyTensor(folder, None, source, model[source]["shape"],
                                                torch.float32 if dtype.is_floating_point else dtype)
            else:
                continue
        out[name] = by_source[source]  # tied names share one object, hence one tensor
    return out


def to_torch_tensor(state_dict, return_empty_tensor=False):
    """Materialise a ``lazy_mode`` state dict; tied names stay one tensor."""
    done: dict[int, torch.Tensor] = {}
    out = OrderedDict()
    for name, lazy in state_dict.items():
        if id(lazy) not in done:
            done[id(lazy)] = torch.empty(lazy.shape, dtype=lazy.dtype) if return_empty_tensor else lazy.contiguous()
        out[name] = done[id(lazy)]
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False,
                                             lazy_mode=False):
    """The checkpoint's weights as an fp32 state dict on CPU. ``checkpoint_dir`` is the folder
    given to ``save_checkpoint`` (the tag defaults to the one in its ``latest`` file). With
    ``lazy_mode`` the values are placeholders read on ``.contiguous()``, one at a time."""
    state_dict = _lazy_state_dict(_checkpoint_folder(checkpoint_dir, tag), exclude_frozen_parameters)
    return state_dict if lazy_mode else to_torch_tensor(state_dict)


def _shards(state_dict, limit: int, weights_name: str) -> list[tuple[str, list[str]]]:
    groups: list[list[str]] = [[]]
    filled, seen = 0, set()
    for name, t in state_dict.items():
        size = 0 if id(t) in seen else t.numel() * torch.empty(0, dtype=t.dtype).element_size()
        seen.add(id(t))
        if groups[-1] and filled + size > limit:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += size
    if len(groups) == 1:
        return [(weights_name, groups[0])]
    stem, ext = os.path.splitext(weights_name)
    return [(f"{stem}-{i + 1:05d}-of-{len(groups):05d}{ext}", g) for i, g in enumerate(groups)]


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, max_shard_size="5GB",
                                               safe_serialization=False, tag=None, exclude_frozen_parameters=False):
    """Write the fp32 weights into ``output_dir`` as ``pytorch_model.bin`` (``model.safetensors``
    with ``safe_serialization``), split into files of at most ``max_shard_size`` with an index
    json when larger, the names Hugging Face's ``from_pretrained`` expects."""
    lazy = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag,
                                                    exclude_frozen_parameters=exclude_frozen_parameters,
                                                    lazy_mode=True)
    weights_name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards = _shards(lazy, _parse_size(max_shard_size), weights_name)
    os.makedirs(output_dir, exist_ok=True)
    weight_map = {}
    for file, names in shards:
        part, written = {}, {}
        for name in names:
            t = lazy[name]
            if id(t) not in written:
                written[id(t)] = t.contiguous()
            part[name] = written[id(t)]
            weight_map[name] = file
        path = os.path.join(output_dir, file)
        if safe_serialization:
            _save_safetensors({k: v.contiguous() for k, v in _untie(part).items()}, path)
        else:
            torch.save(part, path)
    if len(shards) > 1:
        index = "model.safetensors.index.json" if safe_serialization else "pytorch_model.bin.index.json"
        total = sum(lazy[n].numel() * torch.empty(0, dtype=lazy[n].dtype).element_size() for n in lazy)
        with open(os.path.join(output_dir, index), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def _save_safetensors(tensors: dict, path: str) -> None:
    """``safetensors.torch.save_file``; without numpy (which it needs to save, from 0.6 on) the same
    format is written here: 8-byte little-endian header size, JSON header, then the raw bytes."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        pass
    else:
        save_file(tensors, path, metadata={"format": "pt"})
        return
    import ctypes
    import struct
    import sys

    if sys.byteorder != "little":
        raise RuntimeError("writing safetensors without numpy needs a little-endian machine: install numpy")
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in tensors.items():
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in tensors.values():
            t = t.detach().cpu().contiguous()
            f.write(ctypes.string_at(t.data_ptr(), t.nbytes))


def _untie(part: dict) -> dict:
    """safetensors refuses two names on one storage: a tied name gets its own copy."""
    seen, out = set(), {}
    for k, v in part.items():
        out[k] = v.clone() if v.untyped_storage().data_ptr() in seen else v
        seen.add(v.untyped_storage().data_ptr())
    return out


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir, tag=None):
    """Move ``model`` to CPU and load the checkpoint's fp32 weights into it; returns the model."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Consolidate a shardwise checkpoint into fp32 weights")
    parser.add_argument("checkpoint_dir", help="the folder given to save_checkpoint (holding 'latest')")
    parser.add_argument("output_dir", help="where the fp32 weights are written")
    parser.add_argument("--max_shard_size", default="5GB", help="largest output file (e.g. 500MB, 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors, not pytorch_model.bin")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step10 (default: 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_dir,
                                               max_shard_size=args.max_shard_size,
                                               safe_serialization=args.safe_serialization, tag=args.tag,
                                               exclude_frozen_parameters=args.exclude_frozen_parameters)


if __name__ == "__main__":
    main()
