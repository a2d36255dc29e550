"""Moving whole-model weights in and out of an engine, whatever the ZeRO stage.

* :func:`load_partitioned` builds a Hugging Face model already partitioned (``zero.Init``) and
  fills it from the folder's safetensors files one tensor at a time, so no rank ever holds the
  whole model (ZeRO stage 3).
* :func:`gathered_state_dict` is a collective: every rank calls it; each parameter is gathered
  (``zero.GatheredParameters``, a no-op for parameters that are not partitioned) and copied to
  CPU on rank 0 only, one at a time.
"""
from __future__ import annotations

import json
import os

import torch

from shardwise import comm, zero

__all__ = ["gathered_state_dict", "load_partitioned"]


def gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The full state dict on rank 0 (None elsewhere). Tied weights stay one tensor under both
    names, and every tensor has its own storage (engine parameters may be views into flat
    buffers, which safetensors refuses as shared memory)."""
    rank0 = comm.get_rank() == 0
    copies: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in copies:
            with zero.GatheredParameters([tensor] if isinstance(tensor, torch.nn.Parameter) else []):
                copies[id(tensor)] = tensor.detach().cpu().clone().contiguous() if rank0 else None
        state[name] = copies[id(tensor)]
    return state if rank0 else None


def _checkpoint_files(path: str) -> dict[str, str]:
    """tensor name -> safetensors file of a Hugging Face model folder."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"--model_name_or_path: {path} has no model.safetensors(.index.json); partitioned "
                         "(ZeRO-3) loading reads safetensors weights only")
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights  # transformers >= 5
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def load_partitioned(path: str, *, trust_remote_code: bool = False) -> torch.nn.Module:
    """A causal LM from ``path`` whose parameters are partitioned over the data-parallel ranks."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    # Random initialisation would be overwritten below; skipping it also avoids transformers'
    # own init traversal, which indexes into parameters that are already partitioned.
    with _no_init_weights(), zero.Init():
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, dtype=torch.float32)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    files = _checkpoint_files(path)
    prefix = getattr(model, "base_model_prefix", "") + "."
    rank0 = comm.get_rank() == 0
    missing, done = [], set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in done:
            continue
        key = name if name in files else name.removeprefix(prefix) if name.removeprefix(prefix) in files else None
        if key is None:
            missing.append(name)
            continue
        done.add(id(param))
        with zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            if rank0:
                with safe_open(files[key], "pt") as f:
                    param.data.copy_(f.get_tensor(key))
    tied = getattr(config, "tie_word_embeddings", False)
    missing = [m for m in missing if not (tied and m.endswith("lm_head.weight"))]
    if missing:
        raise ValueError(f"--model_name_or_path: {path} has no weights for {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    return model
