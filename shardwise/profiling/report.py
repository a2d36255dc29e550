"""Text report of a flops profile (what ``print_model_profile`` prints)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .flops import FlopsProfiler, ModuleStats


def human(n: float, unit: str) -> str:
    """1234567 -> '1.23 M<unit>'."""
    for div, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div:
            return f"{n / div:.2f} {prefix}{unit}".rstrip()
    return f"{n:g} {unit}".rstrip()


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"


def _rate(flops: float, seconds: float) -> str:
    return human(flops / seconds, "FLOP/s") if seconds > 0 else "n/a"


def _line(s: "ModuleStats", root: "ModuleStats") -> str:
    name = s.name or "(model)"
    return (f"{'  ' * s.depth}{name} ({s.type}): params {human(s.params, '')} ({_pct(s.params, root.params)}), "
            f"MACs {human(s.macs, '')} ({_pct(s.flops, root.flops)}), FLOPs {human(s.flops, '')}, "
            f"latency {s.latency * 1000:.3f} ms ({_pct(s.latency, root.latency)}), {_rate(s.flops, s.latency)}")


def format_profile(prof: "FlopsProfiler", *, profile_step: int, module_depth: int = -1, top_modules: int = 1,
                   detailed: bool = True) -> str:
    root = prof.stats[""]
    bwd = prof.backward_flops
    recompute_note = f" (of which recomputation {human(prof.recompute_flops, 'FLOPs')})" if prof.recompute_flops else ""
    if not prof.recompute_flops and prof.recompute_fwd_factor > 0:
        bwd += int(prof.forward_flops * prof.recompute_fwd_factor)
        recompute_note = f" (+ estimated recomputation, recompute_fwd_factor {prof.recompute_fwd_factor:g})"
    total = prof.forward_flops + bwd + prof.other_flops
    lines = [
        f"{'-' * 30} shardwise flops profiler: step {profile_step} {'-' * 30}",
        f"forward calls of the model:          {root.calls}",
        f"parameters:                          {human(root.params, '')}",
        f"forward FLOPs:                       {human(prof.forward_flops, 'FLOPs')} "
        f"(MACs {human(prof.forward_flops // 2, '')})",
        f"backward FLOPs:                      {human(bwd, 'FLOPs')}{recompute_note}",
        f"other FLOPs (loss, optimizer, ...):  {human(prof.other_flops, 'FLOPs')}",
        f"forward latency:                     {root.latency * 1000:.3f} ms, {_rate(prof.forward_flops, root.latency)}",
        f"profiled wall time:                  {prof.wall_time * 1000:.3f} ms, {_rate(total, prof.wall_time)} "
        f"over {human(total, 'FLOPs')}",
    ]
    max_depth = max((s.depth for s in prof.stats.values()), default=0)
    depths = range(1, max_depth + 1) if module_depth < 0 else range(1, min(module_depth, max_depth) + 1)
    if top_modules > 0 and max_depth > 0:
        lines.append(f"top {top_modules} modules at each depth:")
        for d in depths:
            parts = []
            for key, unit, scale in (("flops", "FLOPs", 1), ("params", "params", 1), ("latency", "ms", 1000)):
                tops = prof.top_modules(d, top_modules, key)
                val = (lambda s: f"{getattr(s, key) * scale:.3f} ms") if key == "latency" else \
                    (lambda s: human(getattr(s, key), unit))
                parts.append(f"by {key}: " + ", ".join(f"{s.name} {val(s)}" for s in tops))
            lines.append(f"  depth {d}: " + " | ".join(parts))
    if detailed:
        limit = max_depth if module_depth < 0 else module_depth
        lines.append(f"per-module profile (forward, depth <= {limit}):")
        lines.extend(_line(s, root) for s in prof.stats.values() if s.depth <= limit)
    lines.append("-" * 80)
    return "\n".join(lines)
