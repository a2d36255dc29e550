"""``shardwise plan``: flags, the human table and the JSON."""

from __future__ import annotations

import argparse
import json
import sys

from shardwise.planning.options import add_plan_arguments, parse_bytes, parse_ranks  # noqa: F401
from shardwise.planning.plan import AXES, GIB, Plan, PlanError, make_plan


def run(ns: argparse.Namespace) -> int:
    plan = make_plan(world=ns.world, gpus_per_node=ns.gpus_per_node, model=ns.model, config=ns.config,
                     gpu_memory=ns.gpu_memory, ranks=ns.ranks, pipe=ns.pipe, seq_len=ns.seq_len,
                     activation_checkpointing=ns.activation_checkpointing, partition_method=ns.partition_method)
    print(format_plan(plan))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(plan.as_dict(), f, indent=1)
    if plan.over_limit:
        worst = max((r for r in plan.ranks if r.rank in plan.over_limit), key=lambda r: r.device_bytes)
        print(f"shardwise plan: error: rank {worst.rank} needs {_gib(worst.device_bytes)} of device memory "
              f"(model states {_gib(worst.model_states_bytes - worst.offloaded_bytes)} + activations "
              f"{_gib(worst.activation_bytes_peak)}), over --gpu_memory {_gib(plan.gpu_memory)}; "
              f"{len(plan.over_limit)} rank(s) over: {_short(plan.over_limit)}", file=sys.stderr)
        return 1
    return 0


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def _short(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")


def _human(n: float) -> str:
    for unit, size in (("TiB", 1024 ** 4), ("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_plan(plan: Plan) -> str:
    d = plan.dims
    lines = [
        f"plan: {plan.world} ranks ({plan.world // plan.gpus_per_node} nodes x {plan.gpus_per_node}), "
        f"{d.describe()}, {plan.precision}",
        f"model: {plan.shape.name}, {plan.parameters:,} parameters, {plan.shape.num_layers} layers, "
        f"hidden {plan.shape.hidden}, {plan.shape.heads} heads ({plan.shape.kv_heads} kv), seq {plan.shape.seq_len}",
        f"batch: {plan.batch['train_batch_size']} = micro {plan.batch['train_micro_batch_size_per_gpu']} x "
        f"accumulation {plan.batch['gradient_accumulation_steps']} x data {d.data}",
        f"process groups: {plan.group_count:,} created in {plan.group_seconds:.2f} s",
        "",
    ]
    cols = ["rank", "coord", "params", "weights", "grads", "fp32 master", "optimizer", "offloaded", "activations",
            "device", *[f"comm {a}" for a in AXES if _axis_used(plan, a)], "cross-node"]
    rows = []
    shown = _shown_ranks(plan)
    for r in shown:
        coord = ",".join(f"{k[0]}{v}" for k, v in r.coord.items())
        flag = " !" if r.rank in plan.over_limit else ""
        rows.append([str(r.rank) + flag, coord, f"{r.parameters:,}", _human(r.params_bytes), _human(r.grads_bytes),
                     _human(r.master_bytes), _human(r.optimizer_bytes), _human(r.offloaded_bytes),
                     _human(r.activation_bytes_peak), _human(r.device_bytes),
                     *[_human(r.comm_bytes[a]) for a in AXES if _axis_used(plan, a)], _human(r.cross_node_bytes)])
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    if len(shown) < len(plan.ranks):
        lines.append(f"({len(plan.ranks) - len(shown)} more ranks with the same figures as a rank shown; --json "
                     "lists every rank)")
    if plan.zeropp:
        lines += ["", _zeropp_line(plan)]
    p = plan.pipeline
    if p["stages"] > 1:
        lines += ["", f"pipeline: {p['stages']} stages, layers {p['layers_per_stage']}, parameters "
                      f"{[f'{x:,}' for x in p['parameters_per_stage']]}, heaviest/mean {p['imbalance']:.3f}, "
                      f"bubble {p['bubble_fraction']:.1%} at {p['micro_batches']} micro-batches"]
    c = plan.checkpoint
    lines += ["", f"checkpoint: {c['files']:,} files, {_human(c['total_bytes'])} (model {_human(c['model_bytes'])}, "
                  f"fp32 master {_human(c['master_bytes'])}, optimizer {_human(c['optimizer_bytes'])})"]
    if plan.gpu_memory:
        verdict = f"{len(plan.over_limit)} rank(s) OVER" if plan.over_limit else "every rank fits"
        lines.append(f"memory: --gpu_memory {_gib(plan.gpu_memory)}: {verdict}")
    lines.append(f"planned in {plan.seconds:.1f} s")
    return "\n".join(lines)


def _zeropp_line(plan: Plan) -> str:
    z = plan.zeropp
    parts = [name for name, on in (("qwZ", z["quantized_weights"]), (f"hpZ k={z['hpz']}", z["hpz"] > 1),
                                   ("qgZ", z["quantized_gradients"]), ("LoCo", z.get("loco"))) if on]
    r = max(plan.ranks, key=lambda r: r.cross_node_bytes)
    groups = ", ".join(f"{g} {_human(v)}" for g, v in r.group_bytes.items() if g in ("data", "node", "inter_node"))
    text = f"ZeRO++: {' + '.join(parts)}"
    if plan.dims.node_size:
        text += (f"; node groups of {z['local']} data ranks on each of {z['nodes']} nodes (nodes of "
                 f"{plan.dims.node_size} ranks)")
    text += f"; rank {r.rank} per step: {groups}; {_human(r.cross_node_bytes)} from other nodes"
    if r.hpz_secondary_bytes:
        text += f"; hpZ secondary weights {_human(r.hpz_secondary_bytes)}"
    if r.loco_error_bytes:
        text += f"; LoCo error buffers {_human(r.loco_error_bytes)}"
    return text


def _axis_used(plan: Plan, axis: str) -> bool:
    return any(r.comm_bytes[axis] for r in plan.ranks)


def _shown_ranks(plan: Plan, limit: int = 16):
    """Every rank when few; else one rank per distinct row of figures (stage, padding), the largest first."""
    if len(plan.ranks) <= limit:
        return plan.ranks
    seen, out = set(), []
    for r in plan.ranks:
        key = (r.coord.get("pipe", 0), r.model_states_bytes, r.activation_bytes_peak, tuple(r.comm_bytes.values()),
               r.cross_node_bytes)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out[:limit]


__all__ = ["add_plan_arguments", "run", "format_plan", "PlanError"]
