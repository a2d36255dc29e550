"""``init_inference``: shard a Hugging Face model with AutoTP for generation across N processes.

Every process runs the same ``generate`` call on the same inputs; the row-parallel all-reduces make
the logits identical on every rank, so greedy decoding yields the same tokens everywhere and the
same tokens as one process. Sampling needs the same seed on every rank.

DeepSpeed-Inference's keys are accepted where they mean something without its CUDA kernels; those
that only tune the kernels are accepted and ignored (listed in ``IGNORED``), and those that ask for a
feature shardwise lacks (kernel injection, CUDA graphs, quantisation, checkpoint loading) are errors.
"""

from __future__ import annotations

import difflib
import json
import os
from typing import Any

import torch
from torch import nn

from shardwise import comm
from shardwise.tensor_parallel.autotp import shard_model

__all__ = ["InferenceEngine", "init_inference", "inference_config"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "int8": torch.int8}
# keys that only tune DeepSpeed's fused kernels / KV cache: accepted and ignored
IGNORED = ("max_out_tokens", "max_tokens", "min_out_tokens", "min_tokens", "triangular_masking", "tm",
           "return_tuple", "transposed_mode", "replace_method", "keep_module_on_host", "triton_autotune")
# keys whose non-default value asks for something shardwise does not do
_REFUSED_UNLESS_DEFAULT = {
    "replace_with_kernel_inject": (False, "kernel injection (DeepSpeed's fused CUDA inference kernels) is not "
                                          "implemented; AutoTP sharding is used, drop replace_with_kernel_inject"),
    "enable_cuda_graph": (False, "CUDA graphs are not implemented"),
    "use_triton": (False, "Triton kernels are not implemented"),
    "checkpoint": (None, "loading a DeepSpeed-Inference checkpoint is not implemented; load the model with "
                         "from_pretrained first"),
    "base_dir": ("", "loading a DeepSpeed-Inference checkpoint is not implemented"),
    "save_mp_checkpoint_path": (None, "saving sharded inference checkpoints is not implemented"),
    "injection_policy": (None, "injection_policy is not implemented: shardwise's AutoTP picks layers by name"),
    "injection_dict": (None, "injection_policy is not implemented: shardwise's AutoTP picks layers by name"),
    "injection_policy_tuple": (None, "injection_policy is not implemented"),
    "training_mp_size": (1, "converting a training checkpoint's model-parallel size is not implemented"),
    "set_empty_params": (False, "set_empty_params is not implemented"),
    "ep_size": (1, "expert parallelism is not implemented"),
    "ep_group": (None, "expert parallelism is not implemented"),
    "ep_mp_group": (None, "expert parallelism is not implemented"),
    "moe_experts": ([1], "mixture of experts is not implemented"),
    "moe_type": ("standard", "mixture of experts is not implemented"),
}
_KNOWN = set(IGNORED) | set(_REFUSED_UNLESS_DEFAULT) | {
    "tensor_parallel", "tp", "mp_size", "mpu", "dtype", "kernel_inject", "zero", "moe", "quant", "config", "args",
    "checkpoint_config", "ckpt_config", "enabled"}


def _plain(value):
    """A config object (DeepSpeed's pydantic ``DeepSpeedInferenceConfig``, ``DeepSpeedTPConfig``, ...) as the
    dict of the fields it was given; anything else as it is."""
    dump = getattr(value, "model_dump", None)
    return dump(exclude_unset=True) if callable(dump) else value


def _load(config) -> dict[str, Any]:
    if config is None:
        return {}
    config = _plain(config)
    if isinstance(config, dict):
        return {key: _plain(value) for key, value in config.items()}
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            return json.load(f)
    raise TypeError(f"init_inference(config=...) takes a dict, a DeepSpeedInferenceConfig or a path to a JSON file, "
                    f"got {type(config).__name__}")


def _switched_on(block) -> bool:
    if isinstance(block, bool):
        return block
    if isinstance(block, dict):
        return bool(block.get("enabled", bool(block))) if block else False
    return block is not None


def inference_config(config=None, **kwargs) -> dict[str, Any]:
    """Validate the merged config (kwargs win, as in DeepSpeed) into ``{"tp_size", "dtype", "mpu", "tp_group"}``."""
    raw = _load(config)
    raw.update({key: _plain(value) for key, value in kwargs.items()})
    problems = []
    for key in raw:
        if key not in _KNOWN:
            close = difflib.get_close_matches(key, sorted(_KNOWN), n=1)
            problems.append(f"init_inference: unknown key '{key}'" + (f"; did you mean '{close[0]}'?" if close else ""))
    if "kernel_inject" in raw:
        raw.setdefault("replace_with_kernel_inject", raw.pop("kernel_inject"))
    for key, (default, why) in _REFUSED_UNLESS_DEFAULT.items():
        if key in raw and raw[key] != default and str(raw[key]).lower() not in (str(default), f"moetypeenum.{default}"):
            problems.append(f"init_inference: {key}={raw[key]!r}: {why}")
    for key, what in (("zero", "ZeRO-Inference"), ("moe", "mixture of experts"), ("quant", "quantisation")):
        if _switched_on(raw.get(key)):
            problems.append(f"init_inference: {key} is switched on but {what} is not implemented")
    tp = raw.get("tensor_parallel", raw.get("tp")) or {}
    if not isinstance(tp, dict):
        problems.append(f"init_inference: tensor_parallel must be a dict like {{\"tp_size\": 2}}, got {tp!r}")
        tp = {}
    bad_tp = sorted(set(tp) - {"tp_size", "tp_grain_size", "mpu", "tp_group", "enabled"})
    if bad_tp:
        problems.append(f"init_inference: unknown key(s) {bad_tp} in tensor_parallel (known: tp_size, tp_grain_size, "
                        "mpu, tp_group, enabled)")
    tp_size = tp.get("tp_size", 1)
    mp_size = raw.get("mp_size")
    if mp_size is not None:  # DeepSpeed's deprecated spelling of tensor_parallel.tp_size
        if "tp_size" in tp and tp_size != mp_size:
            problems.append(f"init_inference: mp_size ({mp_size}) and tensor_parallel.tp_size ({tp_size}) differ")
        tp_size = mp_size
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        problems.append(f"init_inference: tensor_parallel.tp_size must be a positive integer, got {tp_size!r}")
    if tp.get("enabled", True) is False:
        tp_size = 1
    dtype = raw.get("dtype", torch.float16)  # DeepSpeed's default
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.lower().removeprefix("torch."), dtype)
    if dtype == torch.int8:
        problems.append("init_inference: dtype int8 needs DeepSpeed's quantised kernels, which are not implemented")
    elif not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        problems.append(f"init_inference: dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
    if problems:
        raise ValueError("; ".join(problems))
    return {"tp_size": tp_size, "dtype": dtype, "mpu": tp.get("mpu", raw.get("mpu")), "tp_group": tp.get("tp_group")}


class InferenceEngine(nn.Module):
    """The model, converted to ``dtype`` and sharded over its tensor-parallel group; ``generate`` and
    ``forward`` are the model's."""

    def __init__(self, model: nn.Module, config: dict[str, Any]) -> None:
        super().__init__()
        self.module = model
        self._config = config
        tp_size = config["tp_size"]
        self.mp_group = None
        if tp_size > 1:
            comm.init_distributed()
            self.mp_group = self._tensor_group(tp_size, config["mpu"], config["tp_group"])
        model.to(config["dtype"])
        if tp_size > 1:
            shard_model(model, self.mp_group, tp_size=tp_size)

    @staticmethod
    def _tensor_group(tp_size: int, mpu, tp_group):
        if tp_group is not None:
            size = comm.get_world_size(tp_group)
            if size != tp_size:
                raise ValueError(f"init_inference: tensor_parallel.tp_group has {size} ranks but tp_size is {tp_size}")
            return tp_group
        if mpu is not None:
            get = getattr(mpu, "get_tensor_model_parallel_group", None) or mpu.get_model_parallel_group
            return get()
        world = comm.get_world_size()
        if world % tp_size:
            raise ValueError(f"init_inference: tensor_parallel.tp_size ({tp_size}) does not divide the world size "
                             f"({world}); launch a multiple of tp_size processes")
        from shardwise.parallel_dims import ParallelDims
        from shardwise.topology import ParallelGrid

        # the grid's tensor axis: tensor peers are neighbours, ranks [i * tp_size, (i + 1) * tp_size)
        return ParallelGrid.from_dims(ParallelDims(data=world // tp_size, tensor=tp_size)).group("model")

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def generate(self, *args, **kwargs):
        return self.module.generate(*args, **kwargs)


def init_inference(model: nn.Module, config=None, **kwargs) -> InferenceEngine:
    """DeepSpeed's ``deepspeed.init_inference(model, config=None, **kwargs)``: e.g.
    ``init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32)``."""
    return InferenceEngine(model, inference_config(config, **kwargs))
