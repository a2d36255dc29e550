"""The search space: ZeRO stages the config accepts x micro-batch sizes, pruned by the memory estimator."""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass, field

logger = logging.getLogger("shardwise")


@dataclass
class Experiment:
    stage: int
    micro_batch: int
    zero_overrides: dict = field(default_factory=dict)  # extra zero_optimization keys (non-fast mode)

    @property
    def name(self) -> str:
        extra = "".join(f"_{k}{int(v) if isinstance(v, float) else v}" for k, v in sorted(self.zero_overrides.items()))
        return f"z{self.stage}_mbs{self.micro_batch}{extra}"


def requested_stages(raw: dict) -> list[int] | None:
    """Stages the user's JSON asks to tune: a number, a list, or "all"/missing (None = every stage)."""
    stage = raw.get("zero_optimization", {}).get("stage") if isinstance(raw.get("zero_optimization"), dict) else None
    if stage is None or stage == "all":
        return None
    stages = stage if isinstance(stage, list) else [stage]
    if not all(isinstance(s, int) and 0 <= s <= 3 for s in stages):
        raise ValueError(f"zero_optimization.stage: expected 0-3, a list of them or \"all\" for autotuning, got {stage!r}")
    return sorted(set(stages))


def with_stage(raw: dict, stage: int) -> dict:
    cfg = copy.deepcopy(raw)
    zero = cfg.get("zero_optimization")
    cfg["zero_optimization"] = dict(zero) if isinstance(zero, dict) else {}
    cfg["zero_optimization"]["stage"] = stage
    return cfg


def accepted_stages(raw: dict) -> list[int]:
    """The requested stages that this shardwise implements for the rest of the user's config."""
    from shardwise.config import ConfigError, load_config

    wanted = requested_stages(raw)
    ok, refused = [], {}
    for stage in (wanted if wanted is not None else [0, 1, 2, 3]):
        cfg = with_stage(raw, stage)
        cfg.pop("autotuning", None)
        try:
            load_config(cfg).check_supported()
            ok.append(stage)
        except ConfigError as exc:
            refused[stage] = str(exc).splitlines()[-1].strip()
    if wanted is not None and refused:
        raise ValueError("zero_optimization.stage: cannot tune " + "; ".join(f"stage {s} ({why})"
                                                                           for s, why in refused.items()))
    for s, why in refused.items():
        logger.info("autotuning: leaving out ZeRO stage %d: %s", s, why)
    if not ok:
        raise ValueError("autotuning: no ZeRO stage is usable with this config")
    return ok


def micro_batch_candidates(at, *, dp_world_size: int, grad_accum: int) -> list[int]:
    """``num_tuning_micro_batch_sizes`` sizes spread geometrically over the allowed range."""
    lo = at.min_train_micro_batch_size_per_gpu
    hi = at.max_train_micro_batch_size_per_gpu
    if at.max_train_batch_size is not None:
        hi = min(hi, at.max_train_batch_size // (dp_world_size * grad_accum))
    lo = max(lo, math.ceil(at.min_train_batch_size / (dp_world_size * grad_accum)))
    if hi < lo:
        raise ValueError(f"autotuning: no micro-batch size fits: min {lo} > max {hi} "
                         f"(max_train_batch_size / ({dp_world_size} ranks x {grad_accum} accumulation steps))")
    n = at.num_tuning_micro_batch_sizes
    if n == 1 or hi == lo:
        return [hi] if n == 1 else [lo]
    ratio = (hi / lo) ** (1 / (n - 1))
    sizes = sorted({min(hi, max(lo, round(lo * ratio ** i))) for i in range(n)})
    return sizes


def memory_budget_per_rank(num_local_ranks: int) -> tuple[int, str]:
    """Bytes one rank may use on this machine: free accelerator memory, or a share of available RAM."""
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(0)
        return int(free), "accelerator memory"
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    if avail is None:
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return avail // max(1, num_local_ranks), "host memory"


def prune_by_memory(stages: list[int], *, num_params: int, precision: str, dp_world_size: int, num_gpus: int,
                    num_nodes: int, budget: int) -> list[int]:
    """Drop stages whose model states alone would not fit in ``budget`` bytes per rank."""
    from shardwise.profiling.estimator import estimate_model_states

    kept = []
    for s in stages:
        est = estimate_model_states(num_params, num_gpus=num_gpus, num_nodes=num_nodes, stage=s, precision=precision)
        if est.device <= budget:
            kept.append(s)
        else:
            logger.info("autotuning: ZeRO stage %d needs %.2f GiB of model states per rank, more than the %.2f GiB "
                        "available; not tried", s, est.device / 2**30, budget / 2**30)
    return kept
