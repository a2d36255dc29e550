"""Model-state memory per rank: what is allocated, and what ZeRO's arithmetic says it should be.

Ψ = trainable parameter count, N = data-parallel size, b = bytes of a model
weight (2 for fp16/bf16, 4 for fp32), K = optimizer state bytes per element
(Adam: 8).  Per rank:

    params             b·Ψ            (stage 3: b·Ψ/N, plus the units gathered at the moment)
    grads              b·Ψ            (stage 2: b·Ψ/N)
    master weights     4·Ψ / N_s      (16-bit training only; N_s = 1 at stage 0, N otherwise)
    optimizer states   K·Ψ / N_s

e.g. mixed-precision Adam: stage 0 16Ψ, stage 1 4Ψ + 12Ψ/N, stage 2 2Ψ + 14Ψ/N, stage 3 16Ψ/N.

Under tensor parallelism (size T) Ψ is this rank's piece of the model: its share of every tensor-sharded
parameter plus the replicated ones (norms, some biases), about Ψ_model / T, so stage 3 holds about
16Ψ_model/(T·N). ``num_params`` is that piece, ``model_num_params`` the whole model.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from shardwise.zero.partitioned_param import full_numel

# Per-element optimizer state bytes of the common optimizers (fp32 states).
_STATE_BYTES = {"Adam": 8, "AdamW": 8, "Lamb": 8, "Lion": 4, "Adagrad": 4, "RMSprop": 4}


@dataclass(frozen=True)
class MemoryBreakdown:
    params: int
    grads: int
    master_params: int
    optimizer_states: int
    bucket_buffers: int  # transient gradient buckets in flight (stages 2-3), an upper bound
    total: int  # params + grads + master_params + optimizer_states (+ hpz_secondary + loco_errors)
    theoretical: int
    num_params: int
    stage: int
    dp_world_size: int
    precision: str
    live_params: int = 0  # stage 3: gathered (full) parameters alive right now, beyond the shards
    on_disk: int = 0  # NVMe offload: bytes of this rank's files
    tensor_parallel_size: int = 1
    model_num_params: int = 0  # trainable parameters whole over the tensor ranks (num_params: this rank's piece)
    hpz_secondary: int = 0  # ZeRO++ hpZ: the node-local secondary partition of the weights (b·Ψ/k, in total)
    loco_errors: int = 0  # ZeRO++ qgZ with LoCo: the error-feedback buffers (int8, about Ψ + Ψ/k bytes, in total)

    def as_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        mb = 1024 * 1024
        rows = [("params", self.params), ("grads", self.grads), ("master params", self.master_params),
                ("optimizer states", self.optimizer_states), ("total model states", self.total),
                ("theoretical", self.theoretical), ("bucket buffers (bound)", self.bucket_buffers),
                ("gathered params (now)", self.live_params), ("on disk (NVMe offload)", self.on_disk)]
        if self.hpz_secondary:
            rows.append(("hpZ secondary params", self.hpz_secondary))
        if self.loco_errors:
            rows.append(("LoCo error buffers", self.loco_errors))
        head = (f"model states per rank: ZeRO stage {self.stage}, {self.precision}, "
                f"{self.num_params:,} parameters, data-parallel size {self.dp_world_size}")
        if self.tensor_parallel_size > 1:
            head += (f", tensor-parallel size {self.tensor_parallel_size} "
                     f"({self.model_num_params:,} parameters whole over the tensor ranks)")
        return "\n".join([head] + [f"  {k:<24}{v / mb:12.3f} MB" for k, v in rows])


def optimizer_state_bytes_per_element(optimizer) -> int:
    """K: measured from the optimizer's state once it has stepped, else the known value for its class."""
    per_element = numel = 0
    for group in optimizer.param_groups:
        for t in group["params"]:
            state = optimizer.state.get(t)
            if state:
                numel += t.numel()
                per_element += sum(v.nbytes for v in state.values()
                                   if isinstance(v, torch.Tensor) and v.numel() == t.numel())
    if numel:
        return round(per_element / numel)
    if type(optimizer).__name__ == "SGD":
        return 4 if any(g.get("momentum", 0) for g in optimizer.param_groups) else 0
    return _STATE_BYTES.get(type(optimizer).__name__, 8)


def measure(strategy, optimizer, *, precision: str, weight_bytes: int, tensor_size: int = 1) -> MemoryBreakdown:
    """This rank's model-state bytes next to ZeRO's arithmetic; ``tensor_size``: the tensor-parallel size
    (a parameter marked ``tensor_model_parallel`` is one of that many pieces)."""
    parts = strategy.memory_parts()
    n = strategy.dp_world_size
    states = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            states += sum(v.nbytes for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
    parts_of = getattr(strategy, "strategies", None) or [strategy]  # MoE: the dense and the expert strategies
    trainable = [p for part in parts_of for g in part.groups for p in g.params if p.requires_grad]
    psi = sum(full_numel(p) for p in trainable)
    model_psi = sum(full_numel(p) * (tensor_size if getattr(p, "tensor_model_parallel", False) else 1)
                    for p in trainable)
    k = optimizer_state_bytes_per_element(optimizer) if optimizer is not None else 0
    shard = 1 if strategy.replicated else n
    theory = weight_bytes * psi // (n if strategy.shards_parameters else 1)  # parameters
    theory += weight_bytes * psi // (n if strategy.shards_gradients else 1)  # gradients
    theory += (4 * psi // shard) if parts["master_params"] else 0
    theory += k * psi // shard
    hpz = parts.get("hpz_secondary", 0)
    loco = parts.get("loco_errors", 0)
    total = parts["params"] + parts["grads"] + parts["master_params"] + states + hpz + loco
    return MemoryBreakdown(parts["params"], parts["grads"], parts["master_params"], states, parts["bucket_buffers"],
                           total, theory, psi, strategy.stage, n, precision, parts["live_params"], parts["on_disk"],
                           tensor_size, model_psi, hpz, loco)
