"""A checkpoint as one plain fp32 state dict, or a Hugging Face model folder — no cluster needed.

``consolidate_checkpoint(ckpt_dir, out_dir)`` streams the tensors one at a time: trained
parameters from their fp32 master fragments (wherever and however many ranks wrote them),
buffers and frozen parameters from ``model.safetensors`` (floating ones cast to fp32).  They
are packed into ``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_size`` bytes
(a tensor larger than that gets a file of its own) with a ``model.safetensors.index.json``, so
memory holds one parameter plus the shard being filled.  ``hf_config=DIR`` also copies a Hugging
Face model folder's config/tokenizer files, and checks the names against that architecture,
so ``from_pretrained(out_dir)`` loads the result.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardwise.checkpoint.files import fsync_dir, fsync_file
from shardwise.checkpoint.fragments import FragmentReader
from shardwise.checkpoint.tensor_parallel import from_canonical
from shardwise.checkpoint.manifest import Checkpoint, list_tags, open_checkpoint

INDEX_NAME = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json")


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def parse_size(size) -> int:
    """``5000000``, ``"500MB"``, ``"2GiB"`` -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]i?)?B?\s*", str(size), flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size {size!r}: expected bytes or a size like '500MB', '5GB' or '2GiB'")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def _open(checkpoint_dir, tag) -> Checkpoint:
    ckpt = open_checkpoint(checkpoint_dir, tag)
    if ckpt is None:
        raise FileNotFoundError(f"{checkpoint_dir} has no 'latest' file; pass a tag (tags there: "
                                f"{', '.join(list_tags(Path(checkpoint_dir))) or 'none'})")
    return ckpt


def _entries(ckpt: Checkpoint, exclude_frozen: bool) -> list[tuple[str, str, list[int], torch.dtype]]:
    """``(output name, source name, shape, output dtype)`` for every tensor, in state-dict order."""
    tensors = ckpt.manifest["tensors"]
    masters, model = tensors.get("master", {}), tensors["model"]
    frozen = set(ckpt.manifest.get("frozen", [])) if exclude_frozen else set()
    order = ckpt.manifest.get("module_keys") or sorted(set(model) | set(ckpt.manifest.get("aliases", {})))
    out = []
    for name in order:
        source = ckpt.manifest.get("aliases", {}).get(name, name)
        if source in frozen:
            continue
        if source in masters:
            out.append((name, source, masters[source]["shape"], torch.float32))
        elif source in model:
            dtype = getattr(torch, model[source]["dtype"])
            out.append((name, source, model[source]["shape"], torch.float32 if dtype.is_floating_point else dtype))
    return out


def iter_fp32_tensors(ckpt: Checkpoint, *, exclude_frozen_parameters: bool = False):
    """Yield ``(name, tensor)`` one at a time (fp32 for floating tensors), reading only that tensor."""
    masters = ckpt.manifest["tensors"].get("master", {})
    reader = FragmentReader(ckpt, keep_open=False)
    for name, source, shape, dtype in _entries(ckpt, exclude_frozen_parameters):
        if source in masters:
            numel = 1
            for d in shape:
                numel *= d
            t = reader.read_range(masters[source], 0, numel, what=f"master weights of {source}")
            # tensor-sharded: saved with partition_dim first (checkpoint/tensor_parallel.py)
            t = from_canonical(t, list(shape), masters[source].get("partition_dim", 0))
        else:
            with safe_open(str(ckpt.check("model.safetensors")), framework="pt") as fh:
                t = fh.get_tensor(source)
        yield name, t.to(dtype)


def get_fp32_state_dict_from_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False):
    """The whole model as an fp32 state dict in memory (as DeepSpeed's ``zero_to_fp32`` does)."""
    return dict(iter_fp32_tensors(_open(checkpoint_dir, tag), exclude_frozen_parameters=exclude_frozen_parameters))


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Load the checkpoint's fp32 weights into a plain (CPU) ``model``; returns it."""
    model.load_state_dict(get_fp32_state_dict_from_checkpoint(checkpoint_dir, tag), strict=False)
    return model


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = torch.tensor([], dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def consolidate_checkpoint(checkpoint_dir, output_dir, *, tag=None, max_shard_size="5GB", hf_config=None,
                           exclude_frozen_parameters: bool = False) -> Path:
    """Write the checkpoint as sharded fp32 safetensors + index json into ``output_dir``.

    Returns the index path.  With ``hf_config`` (a Hugging Face model folder) its config and
    tokenizer files are copied too and the names are checked against that model."""
    ckpt = _open(checkpoint_dir, tag)
    ckpt.verify()
    limit = parse_size(max_shard_size)
    entries = _entries(ckpt, exclude_frozen_parameters)
    if hf_config is not None:
        _check_hf_names(Path(hf_config), [name for name, *_ in entries], allow_missing=exclude_frozen_parameters)
    shards: list[list[str]] = [[]]
    filled = 0
    for name, _, shape, dtype in entries:  # plan the files first, so their names carry the count
        size = _nbytes(shape, dtype)
        if shards[-1] and filled + size > limit:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    file_of = {name: files[i] for i, names in enumerate(shards) for name in names}
    buffer: dict[str, torch.Tensor] = {}
    current = files[0]
    seen: set[int] = set()
    for name, t in iter_fp32_tensors(ckpt, exclude_frozen_parameters=exclude_frozen_parameters):
        if file_of[name] != current:
            _write_shard(out / current, buffer)
            buffer, current = {}, file_of[name]
        buffer[name] = t.clone() if t.untyped_storage().data_ptr() in seen else t
        seen.add(t.untyped_storage().data_ptr())
    _write_shard(out / current, buffer)
    total = sum(_nbytes(shape, dtype) for _, _, shape, dtype in entries)
    index = out / INDEX_NAME
    tmp = index.with_name(f".{INDEX_NAME}.tmp")
    tmp.write_text(json.dumps({"metadata": {"total_size": total, "format": "pt",
                                            "source": f"{ckpt.folder} (shardwise, step "
                                                      f"{ckpt.manifest['engine']['global_steps']})"},
                               "weight_map": file_of}, indent=1, sort_keys=True))
    os.replace(tmp, index)
    if hf_config is not None:
        _copy_hf_files(Path(hf_config), out)
    fsync_dir(out)
    return index


def _write_shard(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    fsync_file(tmp)
    os.replace(tmp, path)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir, tag=None, exclude_frozen_parameters=False,
                                               max_shard_size="5GB") -> Path:
    """DeepSpeed's name for :func:`consolidate_checkpoint` (always safetensors here)."""
    return consolidate_checkpoint(checkpoint_dir, output_dir, tag=tag, max_shard_size=max_shard_size,
                                  exclude_frozen_parameters=exclude_frozen_parameters)


get_fp32_state_dict_from_zero_checkpoint = get_fp32_state_dict_from_checkpoint


def _copy_hf_files(src: Path, out: Path) -> None:
    for p in sorted(src.iterdir()):
        if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copyfile(p, out / p.name)


def _check_hf_names(src: Path, names: list[str], *, allow_missing: bool) -> None:
    """The checkpoint's names must be the model's (built on the meta device from ``config.json``)."""
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"--hf-config {src}: no config.json there (expected a Hugging Face model folder)")
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(src))
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        return  # no architecture named: nothing to check against
    with torch.device("meta"):
        expected = set(cls(config).state_dict())
    names = {_as_transformers_loads_it(n) for n in names}
    missing = [] if allow_missing else sorted(expected - names)
    unexpected = sorted(names - expected)
    if unexpected or missing:
        raise ValueError(f"checkpoint names do not match {arch} from {src / 'config.json'}: "
                         f"missing {missing[:10]}{' ...' if len(missing) > 10 else ''}, "
                         f"unexpected {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")


# experts stored one by one (the published checkpoints' layout, and AutoEP's): transformers fuses them on loading
_PER_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")


def _as_transformers_loads_it(name: str) -> str:
    m = _PER_EXPERT.match(name)
    if m is None:
        return name
    return f"{m[1]}.{'down_proj' if m[2] in ('down_proj', 'w2') else 'gate_up_proj'}"
