"""Memory estimator: per-rank bytes for model states at each ZeRO stage, before launching.

Ψ parameters, N = num_gpus * num_nodes data-parallel ranks, Adam-style optimizer:

=========  ======================  ===============  =================================
state      bytes per parameter     partitioned at   lives on
=========  ======================  ===============  =================================
params     2 (fp16/bf16) / 4       stage 3          device, host/NVMe with offload_param
grads      2 (fp16/bf16) / 4       stage >= 2       device
master     4 (mixed precision)     stage >= 1       device, host/NVMe with offload_optimizer
optimizer  8 (momentum, variance)  stage >= 1       device, host/NVMe with offload_optimizer
=========  ======================  ===============  =================================

So mixed precision gives 16Ψ (stage 0), 4Ψ + 12Ψ/N (1), 2Ψ + 14Ψ/N (2), 16Ψ/N (3).
With ``tensor_parallel`` T and ``pipeline_parallel`` P a rank holds Ψ/(T·P) of the model (the pieces of
tensor-sharded weights, one stage's layers; replicated norms are ignored) and N is the data-parallel
size, ranks / (T·P): ZeRO-3 in mixed precision holds 16Ψ/(T·P·N).
With ``offload_optimizer`` the optimizer also keeps an fp32 copy of its gradient partition
(4Ψ/N) where the optimizer runs. Activations for transformer shapes follow Korthikanti et al.
(2022): ``s*b*h*(34 + 5*a*s/h)`` bytes per layer in 16-bit, ``2*s*b*h`` per layer kept with
full activation checkpointing (plus one layer's activations while it is recomputed).
ZeRO++'s hpZ (``zero_hpz_partition_size`` k > 1 at stage 3) adds a second copy of the parameters
partitioned over the k ranks of a node, in the working dtype: 2Ψ/k bytes (4Ψ/k in fp32) per rank on the
device (``hpz_params``), so ZeRO-3 in mixed precision holds 16Ψ/N + 2Ψ/k.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch

from shardwise.parallel_dims import ParallelDims

from .params import count_parameters

__all__ = ["MemoryEstimate", "estimate_model_states", "estimate_activations", "estimate_from_model",
           "estimate_from_hf_config", "count_parameters", "hf_model_shape"]

_PRECISIONS = ("fp16", "bf16", "fp32")
_OFFLOAD = ("none", "cpu", "nvme")


@dataclass
class MemoryEstimate:
    """Bytes per rank (``host_per_node``: all ranks of one node together)."""

    num_params: int
    stage: int
    precision: str
    dp_world_size: int
    num_gpus: int
    num_nodes: int
    offload_optimizer: str = "none"
    offload_param: str = "none"
    params: int = 0  # bytes of 16-bit (or fp32) weights held by one rank, wherever they live
    grads: int = 0
    master_params: int = 0
    optimizer_states: int = 0
    offload_grads: int = 0  # fp32 gradient partition next to an offloaded optimizer
    hpz_params: int = 0  # ZeRO++ hpZ: the node-local secondary partition of the weights (working dtype)
    device: int = 0
    host: int = 0
    nvme: int = 0
    activations: int | None = None  # per rank, for the given transformer shape, if any
    activations_checkpointed: int | None = None
    notes: list[str] = field(default_factory=list)
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    hpz_partition_size: int = 1

    @property
    def total(self) -> int:
        """Model-state bytes of one rank (params + grads + master + optimizer states, and hpZ's secondary
        partition of the params), as measured by the engine."""
        return self.params + self.grads + self.master_params + self.optimizer_states + self.hpz_params

    @property
    def host_per_node(self) -> int:
        return self.host * self.num_gpus

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(total=self.total, host_per_node=self.host_per_node)
        return d


def _check(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}")


def estimate_model_states(num_params: float, *, num_gpus: int = 1, num_nodes: int = 1, stage: int = 0,
                          precision: str = "bf16", offload_optimizer: str = "none",
                          offload_param: str = "none", tensor_parallel: int = 1,
                          pipeline_parallel: int = 1, hpz_partition_size: int = 1) -> MemoryEstimate:
    """Per-rank memory for the model states of ``num_params`` trainable parameters; with ``tensor_parallel``
    / ``pipeline_parallel`` > 1 the ranks are a tensor x pipe x data grid (data = ranks / (tensor x pipe)).
    ``hpz_partition_size`` (ZeRO++'s ``zero_hpz_partition_size``, stage 3 only) adds hpZ's secondary partition."""
    psi = int(num_params)
    if psi <= 0:
        raise ValueError(f"the parameter count must be positive, got {num_params!r}")
    if num_gpus < 1 or num_nodes < 1:
        raise ValueError(f"num_gpus and num_nodes must be >= 1, got {num_gpus} and {num_nodes}")
    _check("stage", stage, (0, 1, 2, 3))
    _check("precision", precision, _PRECISIONS)
    _check("offload (optimizer)", offload_optimizer, _OFFLOAD)
    _check("offload_param", offload_param, _OFFLOAD)
    world, model_parallel = num_gpus * num_nodes, tensor_parallel * pipeline_parallel
    for name, size in (("tensor_parallel", tensor_parallel), ("pipeline_parallel", pipeline_parallel),
                       ("hpz_partition_size", hpz_partition_size)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {size!r}")
    if world % model_parallel:
        raise ValueError(f"tensor_parallel {tensor_parallel} x pipeline_parallel {pipeline_parallel} does not divide "
                         f"the {world} ranks (num_gpus x num_nodes)")
    n = world // model_parallel
    if offload_param != "none" and stage != 3:
        raise ValueError(f"offload_param={offload_param!r} with ZeRO stage {stage}: parameter offload needs "
                         "ZeRO stage 3 (DeepSpeed and shardwise ignore it below)")
    if hpz_partition_size > 1 and stage != 3:
        raise ValueError(f"hpz_partition_size={hpz_partition_size} with ZeRO stage {stage}: ZeRO++ (hpZ) needs ZeRO "
                         "stage 3 (zero_optimization.zero_hpz_partition_size)")
    ParallelDims(data=n, tensor=tensor_parallel, pipe=pipeline_parallel, zero_stage=stage,
                 offload_optimizer=offload_optimizer != "none", offload_param=offload_param != "none",
                 hpz_partition=hpz_partition_size).validate(world)  # the one table of allowed combinations
    width = 4 if precision == "fp32" else 2
    psi_rank = math.ceil(psi / model_parallel)  # this rank's piece of the model

    def share(bytes_per_param: int, partitioned: bool) -> int:
        return math.ceil(bytes_per_param * psi_rank / n) if partitioned else bytes_per_param * psi_rank

    est = MemoryEstimate(psi, stage, precision, n, num_gpus, num_nodes, offload_optimizer, offload_param,
                         tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                         hpz_partition_size=hpz_partition_size)
    est.params = share(width, stage >= 3)
    if hpz_partition_size > 1:  # a rank's 1/k of the node's copy, made after each forward all-gather
        est.hpz_params = math.ceil(width * psi_rank / hpz_partition_size)
        if num_gpus % hpz_partition_size:
            est.notes.append(f"hpZ partition size {hpz_partition_size} does not divide the ranks per node "
                             f"({num_gpus}): its groups span nodes, so the backward all-gather crosses them")
    est.grads = share(width, stage >= 2)
    est.master_params = share(4, stage >= 1) if precision != "fp32" else 0
    est.optimizer_states = share(8, stage >= 1)
    where = {"none": "device", "cpu": "host", "nvme": "nvme"}
    placed = {"device": 0, "host": 0, "nvme": 0}
    placed[where[offload_param]] += est.params
    placed["device"] += est.grads + est.hpz_params
    placed[where[offload_optimizer]] += est.master_params + est.optimizer_states
    if offload_optimizer != "none":
        est.offload_grads = share(4, True)
        placed["host"] += est.offload_grads  # the optimizer reads fp32 gradients from host memory
        if precision == "fp32":
            est.notes.append("fp32 with optimizer offload: the fp32 weights on the device are copied to the host")
            est.master_params = share(4, True)
            placed[where[offload_optimizer]] += est.master_params
    if offload_optimizer == "nvme" or offload_param == "nvme":
        est.notes.append("NVMe offload also needs pinned host buffers (aio buffer_count x buffer_size)")
    est.device, est.host, est.nvme = placed["device"], placed["host"], placed["nvme"]
    return est


def estimate_activations(*, seq_len: int, micro_batch: int, hidden_size: int, num_layers: int, num_heads: int,
                         vocab_size: int | None = None, bytes_per_value: int = 2,
                         checkpointing: bool = False) -> int:
    """Activation bytes one rank keeps for backward in a GPT-style transformer (an approximation)."""
    s, b, h, a = seq_len, micro_batch, hidden_size, num_heads
    scale = bytes_per_value / 2  # the 34 + 5as/h formula counts 16-bit values
    per_layer = s * b * h * (34 + 5 * a * s / h) * scale
    logits = s * b * vocab_size * (bytes_per_value + 4) if vocab_size else 0  # logits + fp32 softmax
    if checkpointing:
        return int(num_layers * 2 * s * b * h * scale + per_layer + logits)
    return int(num_layers * per_layer + logits)


def estimate_from_model(model: torch.nn.Module, **kwargs) -> MemoryEstimate:
    """``estimate_model_states`` for the trainable parameters of ``model`` (same keyword arguments)."""
    return estimate_model_states(count_parameters(model), **kwargs)


def hf_model_shape(path: str) -> dict:
    """Parameter count and transformer shape of a Hugging Face config folder (built on the meta device)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_file):
        raise ValueError(f"--model {path}: no config.json there (give a Hugging Face model folder)")
    try:
        import transformers
    except ImportError as exc:
        raise ImportError("--model needs the transformers package: pip install 'shardwise[hf]'") from exc
    cfg = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:  # not a causal LM: the bare model
            model = transformers.AutoModel.from_config(cfg)
    get = lambda *names: next((getattr(cfg, n) for n in names if getattr(cfg, n, None) is not None), None)  # noqa: E731
    return {
        "num_params": count_parameters(model, trainable_only=False),
        "hidden_size": get("hidden_size", "n_embd", "d_model"),
        "num_layers": get("num_hidden_layers", "n_layer", "num_layers"),
        "num_heads": get("num_attention_heads", "n_head", "num_heads"),
        "vocab_size": get("vocab_size"),
        "max_seq_len": get("max_position_embeddings", "n_positions", "seq_length"),
        "model_type": getattr(cfg, "model_type", None),
    }


def estimate_from_hf_config(path: str, **kwargs) -> MemoryEstimate:
    """``estimate_model_states`` for the model a Hugging Face ``config.json`` folder describes."""
    return estimate_model_states(hf_model_shape(path)["num_params"], **kwargs)
