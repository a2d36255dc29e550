"""``deepspeed.module_inject.auto_ep_folding``: the rank tables of DeepSpeed's AutoEP + AutoTP "folding"
layout and its up-front validation (pure topology; no process group is made here).

Per pipeline stage of ``stage_size = world / pp`` consecutive ranks:

* tensor groups: consecutive runs of ``tp`` ranks; dense data-parallel groups: one rank per tensor lane
  (stride ``tp``);
* expert groups: consecutive runs of ``ep`` ranks (so an expert group may span tensor lanes);
  expert-data-parallel groups: the ranks at one position of every expert group.

shardwise's own AutoEP does not fold its expert groups onto the tensor groups (``shardwise.moe``); these
tables describe DeepSpeed's layout for code that builds or checks it. The gradient-family helpers of this
module (``reduce_autoep_folding_gradient``, ...) are not provided."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["AUTOEP_FOLDING_GRAD_CORRECTED_ATTR", "AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE",
           "AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL", "AUTOEP_FOLDING_GRAD_REDUCE_SKIP",
           "AUTOEP_FOLDING_GRAD_REDUCE_SUM", "AUTOEP_FOLDING_PARAM_FAMILY_ATTR",
           "AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM", "AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM",
           "AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM", "FoldingGroupHandles", "FoldingGroupTables",
           "ParallelFoldingSpec", "assert_group_matches_spec", "build_folding_spec", "expected_folding_group_tables",
           "local_folding_ranks", "validate_folding_global"]

AUTOEP_FOLDING_PARAM_FAMILY_ATTR = "ds_autoep_folding_param_family"
AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM = "router_gate_replicated"
AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM = "router_gate_partial"
AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM = "sp_sharded_layernorm"
AUTOEP_FOLDING_GRAD_CORRECTED_ATTR = "ds_autoep_folding_grad_corrected"
AUTOEP_FOLDING_GRAD_REDUCE_SKIP = "skip"
AUTOEP_FOLDING_GRAD_REDUCE_SUM = "sum"
AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE = "average"
AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL = "expert_tp_cancel"


@dataclass(frozen=True)
class ParallelFoldingSpec:
    world_size: int
    pp_size: int
    stage_size: int
    tp_size: int
    dp_size: int
    ep_size: int
    etp_size: int
    edp_size: int
    mp_mode: str = "tp"


@dataclass(frozen=True)
class FoldingGroupTables:
    tp_groups: tuple[tuple[int, ...], ...]
    dense_dp_groups: tuple[tuple[int, ...], ...]
    ep_groups: tuple[tuple[int, ...], ...]
    edp_groups: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class FoldingGroupHandles:
    """The process groups one rank built for a folding spec, with the rank tuples they were made from."""
    spec: ParallelFoldingSpec
    tp_group: object
    dense_dp_group: object
    ep_group: object
    edp_group: object
    ep_group_name: str
    tp_ranks: tuple[int, ...]
    dense_dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def build_folding_spec(*, world_size: int, pp_size: int, tp_size: int, ep_size: int, etp_size: int = 1,
                       mp_mode: str = "tp") -> ParallelFoldingSpec:
    """The folding layout of ``world_size`` ranks. Every size must be a positive integer, ``pp`` must divide
    the world, and ``tp`` and ``ep * etp`` must divide the stage; otherwise a ``ValueError`` names the config
    key and lists the sizes that would work."""
    for name, value in (("world_size", world_size), ("pp_size", pp_size), ("tensor_parallel.autotp_size", tp_size),
                        ("expert_parallel.autoep_size", ep_size),
                        ("expert_parallel.expert_tensor_parallel_size", etp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size % pp_size:
        raise ValueError(f"pp_size={pp_size} must divide world_size={world_size}. "
                         f"Valid pp_size values: {_divisors(world_size)}")
    stage = world_size // pp_size
    if stage % tp_size:
        raise ValueError(f"tensor_parallel.autotp_size={tp_size} must divide the stage size (world_size={world_size} "
                         f"/ pp_size={pp_size} = {stage}). Valid autotp_size values: {_divisors(stage)}")
    width = ep_size * etp_size
    if stage % width:
        raise ValueError(f"expert_parallel.autoep_size * expert_parallel.expert_tensor_parallel_size ({ep_size} * "
                         f"{etp_size} = {width}) must divide the stage size (world_size={world_size} / "
                         f"pp_size={pp_size} = {stage}). Valid expert-width values: {_divisors(stage)}")
    return ParallelFoldingSpec(world_size=world_size, pp_size=pp_size, stage_size=stage, tp_size=tp_size,
                               dp_size=stage // tp_size, ep_size=ep_size, etp_size=etp_size, edp_size=stage // width,
                               mp_mode=mp_mode)


def expected_folding_group_tables(spec: ParallelFoldingSpec) -> FoldingGroupTables:
    """Every tensor, dense data-parallel, expert and expert-data-parallel rank group of ``spec``."""
    tp, dense_dp, ep, edp = [], [], [], []
    for first in range(0, spec.world_size, spec.stage_size):
        stage = list(range(first, first + spec.stage_size))
        tp += [tuple(stage[i:i + spec.tp_size]) for i in range(0, spec.stage_size, spec.tp_size)]
        dense_dp += [tuple(stage[lane::spec.tp_size]) for lane in range(spec.tp_size)]
        stage_ep = [tuple(stage[i:i + spec.ep_size]) for i in range(0, spec.stage_size, spec.ep_size)]
        ep += stage_ep
        edp += [tuple(group[pos] for group in stage_ep) for pos in range(spec.ep_size)]
    return FoldingGroupTables(tp_groups=tuple(tp), dense_dp_groups=tuple(dense_dp), ep_groups=tuple(ep),
                              edp_groups=tuple(edp))


def local_folding_ranks(global_rank: int, spec: ParallelFoldingSpec) -> dict[str, tuple[int, ...]]:
    """The groups ``global_rank`` belongs to: ``{"tp", "dense_dp", "ep", "edp"}`` -> rank tuple."""
    tables = expected_folding_group_tables(spec)
    return {name: next(group for group in groups if global_rank in group)
            for name, groups in (("tp", tables.tp_groups), ("dense_dp", tables.dense_dp_groups),
                                 ("ep", tables.ep_groups), ("edp", tables.edp_groups))}


def _mpu_world_size(mpu, *names: str):
    for name in names:
        getter = getattr(mpu, name, None) if mpu is not None else None
        if getter is not None:
            return getter()
    return None


def validate_folding_global(spec: ParallelFoldingSpec, *, zero_stage: int = 0, sp_size: int = 1,
                            deepcompile_enabled: bool = False, use_data_before_expert_parallel: bool = False,
                            mpu=None, autoep_enabled: bool = True, tp_preset: str | None = None,
                            ep_preset: str | None = None, zero_offload_optimizer: bool = False,
                            zero_offload_param: bool = False) -> None:
    """DeepSpeed's limits of a folded (``tp > 1``) AutoEP layout, checked before any group is made; each
    violation is a ``ValueError`` naming the config keys."""
    if not autoep_enabled:
        return
    folded = spec.tp_size > 1
    if deepcompile_enabled and folded:
        raise ValueError("DeepCompile with AutoEP+AutoTP folding is not supported; disable compile.deepcompile or "
                         "use non-folded AutoEP with tensor_parallel.autotp_size=1.")
    if folded and spec.pp_size > 1:
        raise ValueError(f"AutoEP+AutoTP folding currently supports pp_size=1 only; got pp_size={spec.pp_size}.")
    if folded and sp_size > 1:
        raise ValueError("tensor_parallel.autotp_size and Ulysses sequence parallelism are mutually exclusive for "
                         f"AutoEP folding (autotp_size={spec.tp_size}, sp_size={sp_size}).")
    if spec.etp_size != 1:
        raise ValueError(f"expert_parallel.expert_tensor_parallel_size={spec.etp_size} (expert-internal tensor "
                         "parallelism) is not supported; use expert_tensor_parallel_size=1.")
    if tp_preset is not None and ep_preset is not None and tp_preset != ep_preset:
        raise ValueError("tensor_parallel.preset_model and expert_parallel.preset_model must match when both are "
                         f"set (tensor_parallel.preset_model={tp_preset!r}, expert_parallel.preset_model={ep_preset!r}).")
    if folded and spec.ep_size == 1:
        raise ValueError("AutoEP+AutoTP folding requires expert_parallel.autoep_size > 1 (with ep=1 every tensor "
                         "lane would count the routed tokens' gradients again).")
    if folded and use_data_before_expert_parallel:
        raise ValueError("use_data_before_expert_parallel_ is not supported with AutoEP+AutoTP folding; disable it.")
    if folded and (zero_offload_optimizer or zero_offload_param):
        raise ValueError("ZeRO optimizer/parameter offload with AutoEP+AutoTP folding is not supported; disable "
                         "offload.")
    mpu_tp = _mpu_world_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    if mpu_tp not in (None, 1, spec.tp_size):
        raise ValueError(f"mpu tensor/model parallel world size ({mpu_tp}) conflicts with "
                         f"tensor_parallel.autotp_size={spec.tp_size}.")
    mpu_pp = _mpu_world_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipeline_parallel_world_size")
    if mpu_pp not in (None, spec.pp_size):
        raise ValueError(f"mpu pipeline parallel world size ({mpu_pp}) conflicts with pp_size={spec.pp_size}.")


def _rank_groups(groups: Iterable[Iterable[int]]) -> set[tuple[int, ...]]:
    return {tuple(int(r) for r in group) for group in groups}


def assert_group_matches_spec(existing_rank_lists, spec: ParallelFoldingSpec, *, group_kind: str = "ep_edp") -> None:
    """Refuse (``RuntimeError``) cached expert / expert-data-parallel rank lists -- ``(ep, edp)`` or
    ``{"ep": ..., "edp": ...}`` -- holding a group the folding spec does not have."""
    tables = expected_folding_group_tables(spec)
    if isinstance(existing_rank_lists, dict):
        seen_ep, seen_edp = existing_rank_lists.get("ep", []), existing_rank_lists.get("edp", [])
    else:
        seen_ep, seen_edp = existing_rank_lists
    for kind, seen, want in (("expert-parallel", seen_ep, tables.ep_groups),
                             ("expert-data-parallel", seen_edp, tables.edp_groups)):
        expected = _rank_groups(want)
        for group in _rank_groups(seen):
            if group not in expected:
                raise RuntimeError(f"Cached {kind} group {group} does not match folding spec {spec}.")
