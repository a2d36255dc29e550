"""``shardwise estimate``: print the memory estimate table for a parameter count or a model folder."""

from __future__ import annotations

import argparse

from .estimator import MemoryEstimate, estimate_activations, estimate_model_states, hf_model_shape


def human_bytes(n: float) -> str:
    for div, unit in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number like 6.2e9, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--params", type=_positive_float, help="number of trainable parameters, e.g. 6.2e9")
    src.add_argument("--model", metavar="DIR", help="a Hugging Face model folder (its config.json is enough)")
    p.add_argument("--num_gpus", type=int, default=1, help="accelerators (ranks) per node (default 1)")
    p.add_argument("--num_nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--tensor_parallel", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pipeline_parallel", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), help="only this ZeRO stage (default: all)")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"),
                   help="optimizer offload (offload_optimizer.device); default: show none and cpu")
    p.add_argument("--offload_param", choices=("none", "cpu", "nvme"), default="none",
                   help="parameter offload at stage 3 (offload_param.device)")
    p.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="bf16")
    p.add_argument("--zero_hpz_partition_size", type=int, default=1, metavar="K",
                   help="ZeRO++ hpZ at stage 3: a second copy of the weights partitioned over K ranks (default 1: off)")
    act = p.add_argument_group("activations (transformer shapes; --model fills in what it knows)")
    act.add_argument("--seq_len", type=int, help="sequence length")
    act.add_argument("--micro_batch", type=int, default=1, help="micro-batch size per rank (default 1)")
    act.add_argument("--hidden_size", type=int)
    act.add_argument("--num_layers", type=int)
    act.add_argument("--num_heads", type=int)
    act.add_argument("--vocab_size", type=int)


def _variants(ns) -> list[tuple[int, str, str]]:
    stages = [ns.stage] if ns.stage is not None else [0, 1, 2, 3]
    out = []
    for s in stages:
        offloads = [ns.offload] if ns.offload else (["none"] if s == 0 else ["none", "cpu"])
        for off in offloads:
            params = ns.offload_param if s == 3 else "none"
            out.append((s, off, params))
    return out


def build_estimates(ns) -> tuple[list[MemoryEstimate], dict]:
    shape = {}
    if ns.model:
        shape = hf_model_shape(ns.model)
        num_params = shape["num_params"]
    else:
        num_params = ns.params
    for key in ("hidden_size", "num_layers", "num_heads", "vocab_size"):
        if getattr(ns, key) is not None:
            shape[key] = getattr(ns, key)
    shape["micro_batch"] = ns.micro_batch
    if ns.seq_len is not None:
        shape["seq_len"] = ns.seq_len
    elif shape.get("max_seq_len"):
        shape["seq_len"] = shape["max_seq_len"]
    estimates = []
    for stage, off, off_param in _variants(ns):
        estimates.append(estimate_model_states(num_params, num_gpus=ns.num_gpus, num_nodes=ns.num_nodes, stage=stage,
                                               precision=ns.precision, offload_optimizer=off,
                                               offload_param=off_param, tensor_parallel=ns.tensor_parallel,
                                               pipeline_parallel=ns.pipeline_parallel,
                                               hpz_partition_size=ns.zero_hpz_partition_size if stage == 3 else 1))
    if all(shape.get(k) for k in ("seq_len", "hidden_size", "num_layers", "num_heads")):
        kw = dict(seq_len=shape["seq_len"], micro_batch=ns.micro_batch, hidden_size=shape["hidden_size"],
                  num_layers=shape["num_layers"], num_heads=shape["num_heads"], vocab_size=shape.get("vocab_size"),
                  bytes_per_value=4 if ns.precision == "fp32" else 2)
        for e in estimates:
            e.activations = estimate_activations(**kw)
            e.activations_checkpointed = estimate_activations(**kw, checkpointing=True)
    return estimates, shape


def format_table(estimates: list[MemoryEstimate], shape: dict) -> str:
    e0 = estimates[0]
    lines = [f"Model states per rank: {e0.num_params:,} trainable parameters ({e0.num_params / 1e9:.3f}B), "
             f"{e0.num_gpus} rank(s) x {e0.num_nodes} node(s) (N={e0.dp_world_size}), {e0.precision}, Adam-style optimizer"]
    if e0.tensor_parallel * e0.pipeline_parallel > 1:
        lines[0] += (f"; tensor {e0.tensor_parallel} x pipe {e0.pipeline_parallel} x data {e0.dp_world_size}: "
                     f"a rank holds 1/{e0.tensor_parallel * e0.pipeline_parallel} of the model")
    header = f"{'stage':>5}  {'offload opt/param':<17}  {'device/rank':>12}  {'host/rank':>12}  {'host/node':>12}  {'nvme/rank':>12}"
    lines += [header, "-" * len(header)]
    for e in estimates:
        lines.append(f"{e.stage:>5}  {e.offload_optimizer + '/' + e.offload_param:<17}  {human_bytes(e.device):>12}  "
                     f"{human_bytes(e.host):>12}  {human_bytes(e.host_per_node):>12}  {human_bytes(e.nvme):>12}")
    if e0.activations is not None:
        lines.append(f"Activations per rank (seq {shape['seq_len']}, micro-batch {shape['micro_batch']}, hidden {shape['hidden_size']}, "
                     f"{shape['num_layers']} layers, {shape['num_heads']} heads): {human_bytes(e0.activations)}; "
                     f"with activation checkpointing {human_bytes(e0.activations_checkpointed)} (on the device, "
                     "in addition to the model states)")
    else:
        lines.append("Activations: give --seq_len, --hidden_size, --num_layers and --num_heads (or --model) for an estimate")
    for e in estimates:
        if e.hpz_params:
            lines.append(f"stage 3 with hpZ (zero_hpz_partition_size {e.hpz_partition_size}): the device figure "
                         f"includes {human_bytes(e.hpz_params)} per rank of secondary weight partition")
            break
    notes = sorted({n for e in estimates for n in e.notes})
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def run(ns) -> int:
    if ns.num_gpus < 1 or ns.num_nodes < 1:
        raise ValueError(f"--num_gpus and --num_nodes must be >= 1, got {ns.num_gpus} and {ns.num_nodes}")
    estimates, shape = build_estimates(ns)
    print(format_table(estimates, shape))
    return 0
