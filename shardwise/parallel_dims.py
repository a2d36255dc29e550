"""``ParallelDims``: the size of every parallel axis and the features that constrain them, in one
frozen record, and ``validate()``, the one table of which combinations train.

Everything that checks a combination (``initialize``, the engine, the pipeline
engine, the 1-bit optimizers, the ZeRO factory, the memory estimator) asks this record. The grid of
process groups is cut from it (``shardwise.topology.ParallelGrid.from_dims``). docs/engine.md prints
the table (``combination_table()``); a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Callable

from shardwise.rank_layout import (  # noqa: F401  (check_expert_size: the one "ep divides data" check, named here too)
    ProcessTopology, check_expert_size, expert_divides, node_rank_lists, zero_data_ranks)

AXES = ("data", "pipe", "tensor", "sequence", "expert")


@dataclass(frozen=True)
class ParallelDims:
    data: int = 1
    pipe: int = 1
    tensor: int = 1
    sequence: int = 1
    expert: int = 1  # MoE expert parallelism: experts split over this many of the data x sequence ranks
    # (a sub-axis of data: it adds no ranks; the grid cuts the expert and expert-data groups from it)
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    compressed_optimizer: str | None = None  # 1-bit Adam & co: the optimizer's class name
    compressed_zero1: bool = False  # that optimizer runs at ZeRO stage 1 too (OneBitAdam)
    tied_pipeline_layers: bool = False  # a PipelineModule with layers tied across stages
    virtual_stages: int = 1  # interleaved pipeline schedule
    # features that some sizes refuse (the rules below; each set where it is known)
    muon: bool = False  # optimizer.type Muon
    moe: bool = False  # the model has MoE layers
    experts_unsplit_by_tensor: bool = False  # MoE blocks that cannot share expert slots over tensor ranks (AutoEP's)
    partition_activations: bool = False  # activation_checkpointing.partition_activations
    sequence_parallel_params: bool = False  # parameters marked sequence_parallel=True (Megatron sequence parallelism)
    curriculum_sampling: bool = False  # data_efficiency.data_sampling.curriculum_learning
    hpz_partition: int = 1  # ZeRO++ hpZ: zero_optimization.zero_hpz_partition_size at stage 3
    # ZeRO++ nodes: ranks per node (a rank's node is rank // node_size) where a ZeRO++ part that needs node
    # boundaries is on (hpZ, qgZ): zero_hpz_partition_size when above 1, else the launcher's ranks per node.
    # A sub-axis of data like expert (it adds no ranks); the grid cuts the node and inter-node groups from it.
    # 0: no node groups.
    node_size: int = 0

    @property
    def world_size(self) -> int:
        return self.data * self.pipe * self.tensor * self.sequence

    @property
    def expert_data(self) -> int:
        """The ranks holding replicas of one expert: the data x sequence ranks that route tokens, over the
        expert size (validate() refuses an expert size that does not divide them)."""
        return self.data * self.sequence // self.expert

    @property
    def model_parallel(self) -> int:
        """Ranks holding different pieces of one replica's model (pipe x tensor)."""
        return self.pipe * self.tensor

    def replace(self, **changes) -> "ParallelDims":
        return replace(self, **changes)

    def validate(self, world_size: int | None = None) -> "ParallelDims":
        """Raise ``ValueError`` naming the first offending size or pair; return self when all hold."""
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"the {axis}-parallel size must be an integer >= 1, got {size!r}")
        if not isinstance(self.node_size, int) or self.node_size < 0:
            raise ValueError(f"the ZeRO++ node size (ranks per node) must be an integer >= 0, got {self.node_size!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for rule in RULES:
            if rule.applies(self):
                raise ValueError(rule.message(self, block="a MoE block"))
        if world_size is not None and self.world_size != world_size:
            raise ValueError(f"data {self.data} x pipe {self.pipe} x tensor {self.tensor} x sequence {self.sequence} "
                             f"= {self.world_size} ranks, but the world has {world_size}")
        return self

    def describe(self) -> str:
        sizes = " x ".join(f"{a} {getattr(self, a)}" for a in AXES if getattr(self, a) > 1) or "one rank"
        return f"{sizes}, ZeRO stage {self.zero_stage}"


@lru_cache(maxsize=64)
def data_ranks_per_node(d: ParallelDims) -> int | None:
    """How many of each data-parallel group's ranks (data x sequence, what ZeRO partitions over) every node
    holds, nodes being ``d.node_size`` consecutive ranks of ``ProcessTopology.from_dims(d)``'s layout; None
    when some node holds more of a group than another (or ``d.node_size`` is 0)."""
    if d.node_size < 1:
        return None
    counts = set()
    for ranks in zero_data_ranks(ProcessTopology.from_dims(d)):
        try:
            local, _ = node_rank_lists(ranks, d.node_size)
        except ValueError:
            return None
        counts.add(len(local[0]))
    return counts.pop() if len(counts) == 1 else None


@dataclass(frozen=True)
class Rule:
    """One refused combination, ``pair`` (with this configuration's values filled in), when ``applies``."""

    pair: str  # e.g. "zero_optimization.stage 3 with tensor parallelism (tensor size {tensor})"
    table: str  # the same pair for the docs' table
    applies: Callable[[ParallelDims], bool]
    why: str | Callable[[ParallelDims], str]
    name: str = ""  # how a site that knows the facts only late asks for this rule (``check_rule``)

    def message(self, d: ParallelDims, **context) -> str:
        why = self.why(d) if callable(self.why) else self.why
        return f"{_fill(self.pair, d, **context)}: not supported. {why}"


def _fill(text: str, d: ParallelDims, **context) -> str:
    return text.format(**{"world_size": d.world_size, **{f.name: getattr(d, f.name) for f in fields(d)}, **context})


def check_rule(name: str, dims: ParallelDims, **context) -> None:
    """Raise the table's ``ValueError`` when the rule ``name`` refuses ``dims``. For the refusals whose facts
    are known only where they are checked (the optimizer object, the model's parameters); ``context`` fills
    the rule's other placeholders (``{block}``)."""
    rule = next((r for r in RULES if r.name == name), None)
    if rule is None:
        raise KeyError(f"no refusal named {name!r} in shardwise.parallel_dims.RULES")
    if rule.applies(dims):
        raise ValueError(rule.message(dims, **context))


def _compressed(d: ParallelDims) -> bool:
    return d.compressed_optimizer is not None


_STAGE1_WHY = {
    "ZeroOneAdam": "ZeroOneAdam's local steps move every rank's own copy of the whole momentum and weights "
                   "apart between synchronisations; at stage 1 a rank keeps only 1/N of the momentum",
    "OneBitLamb": "OneBitLamb's trust ratios need the norms of whole tensors of weights, momentum and fresh "
                  "variance every step; at stage 1 they are cut across ranks",
    None: "its exchange needs the whole momentum on every rank; at stage 1 a rank keeps only 1/N of it",
}
_ONEBIT = "the 1-bit optimizers average the momentum of whole, replicated tensors with their own compressed exchange"

# The table of allowed combinations: anything not refused here trains (docs/engine.md prints it).
RULES: tuple[Rule, ...] = (
    Rule("MoE ep_size {expert} with {data} data-parallel x {sequence} sequence-parallel ranks",
         "expert size not dividing data x sequence", lambda d: not expert_divides(d.expert, d.data * d.sequence),
         "the experts of a layer are split over ep_size ranks of the data axis (with sequence parallelism, of "
         "data x sequence: every rank routes its own tokens): ep_size must divide it"),
    Rule("expert parallelism (ep_size {expert}) with tensor parallelism (tensor {tensor}) and sequence "
         "parallelism (sequence {sequence})", "expert > 1 with tensor > 1 and sequence > 1",
         lambda d: d.expert > 1 and d.tensor > 1 and d.sequence > 1, "not implemented yet"),
    Rule("expert parallelism (ep_size {expert}) with optimizer.type={compressed_optimizer}",
         "expert > 1 with a 1-bit optimizer", lambda d: d.expert > 1 and _compressed(d),
         "the 1-bit optimizers exchange whole replicated momentum; experts are not replicated"),
    Rule("layers tied across pipeline stages with zero_optimization.stage {zero_stage}",
         "tied pipeline layers with ZeRO stage 1-3", lambda d: d.tied_pipeline_layers and d.zero_stage > 0,
         "tied gradients are summed over the stages holding them, which partitioned gradients do not allow yet; "
         "use zero_optimization.stage 0"),
    Rule("the interleaved pipeline schedule (virtual_stages {virtual_stages}) with zero_optimization.stage 3",
         "virtual_stages > 1 with ZeRO stage 3", lambda d: d.virtual_stages > 1 and d.zero_stage == 3,
         "use the 1F1B or GPipe schedule, or ZeRO stage 0-2"),
    Rule("zero_optimization.zero_hpz_partition_size {hpz_partition} with {data} data-parallel x {sequence} "
         "sequence-parallel ranks", "zero_hpz_partition_size not dividing data x sequence (ZeRO-3's ranks)",
         lambda d: d.hpz_partition > 1 and (d.data * d.sequence) % d.hpz_partition != 0,
         "hpZ keeps a second copy of each ZeRO-3 parameter partitioned over groups of that many ranks (one "
         "node's); the ranks ZeRO-3 partitions over must split into whole groups: use the ranks per node, a "
         "divisor of them, or 1", name="zero_hpz"),
    Rule("ZeRO++ nodes of {node_size} ranks (zero_hpz_partition_size, else the launcher's ranks per node) with "
         "{data} data-parallel x {sequence} sequence-parallel x {tensor} tensor-parallel x {pipe} pipeline ranks",
         "ZeRO++ (hpZ, qgZ) with nodes holding unequal shares of a data-parallel group",
         lambda d: d.node_size > 0 and data_ranks_per_node(d) is None,
         "ZeRO++'s node groups are the data-parallel ranks on one node (a rank's node is rank // ranks per node): "
         "every node must hold as many of each data-parallel group's ranks as every other", name="zero_nodes"),
    Rule("zero_optimization.zero_hpz_partition_size {hpz_partition} with {tensor} tensor-parallel x {pipe} "
         "pipeline ranks", "zero_hpz_partition_size with nodes holding other ranks than one data-parallel group's",
         lambda d: d.hpz_partition > 1 and d.node_size > 0 and data_ranks_per_node(d) not in (None, d.hpz_partition),
         "hpZ's node is zero_hpz_partition_size consecutive ranks, and its secondary partition is over the data-"
         "parallel ranks on it: they must be all of them (tensor-parallel peers are neighbours, so a node of that "
         "many ranks holds several data-parallel groups' ranks); use zero_hpz_partition_size 1 with tensor "
         "parallelism", name="zero_hpz_node"),
    Rule("zero_optimization.offload_optimizer with zero_optimization.stage 0",
         "optimizer offload with ZeRO stage 0", lambda d: d.offload_optimizer and d.zero_stage == 0,
         "optimizer offload needs ZeRO stage 1, 2 or 3 (stage 0 keeps the optimizer on every rank)"),
    Rule("optimizer.type={compressed_optimizer} with zero_optimization.stage=1",
         "ZeroOneAdam or OneBitLamb with ZeRO stage 1",
         lambda d: _compressed(d) and d.zero_stage == 1 and not d.compressed_zero1,
         lambda d: _STAGE1_WHY.get(d.compressed_optimizer, _STAGE1_WHY[None])
         + ". Use zero_optimization.stage 0 (OneBitAdam also runs at stage 1)"),
    Rule("optimizer.type={compressed_optimizer} with zero_optimization.stage={zero_stage}",
         "a 1-bit optimizer with ZeRO stage 2 or 3", lambda d: _compressed(d) and d.zero_stage >= 2,
         _ONEBIT + "; at stages 2 and 3 each rank keeps only its 1/N share of the gradients (at stage 3 the "
         "parameters themselves are partitioned), so there is no whole local gradient to compress. "
         "Use zero_optimization.stage 0 or 1 (stage 1 with OneBitAdam)"),
    Rule("optimizer.type={compressed_optimizer} with zero_optimization.offload_optimizer",
         "a 1-bit optimizer with optimizer offload", lambda d: _compressed(d) and d.offload_optimizer,
         _ONEBIT + "; their step runs on the device"),
    Rule("optimizer.type={compressed_optimizer} with pipeline parallelism ({pipe} stages)",
         "a 1-bit optimizer with pipe > 1", lambda d: _compressed(d) and d.pipe > 1,
         "the pipeline's gradient reduction cannot be handed over to the optimizer yet "
         "(DeepSpeed's pipeline_enable_backward_allreduce)"),
    Rule("optimizer.type=Muon with zero_optimization.offload_optimizer", "Muon with optimizer offload",
         lambda d: d.muon and d.offload_optimizer,
         "not implemented yet (the offloaded step runs sub-group by sub-group; Muon needs every matrix at once)",
         name="muon_offload"),
    Rule("optimizer.type=Muon with expert parallelism (ep_size {expert}, tensor {tensor})",
         "Muon with MoE experts reduced over their own groups (expert > 1, or tensor > 1)",
         lambda d: d.muon and d.moe and (d.expert > 1 or d.tensor > 1),
         "not implemented yet: Muon assembles each matrix over one data group, not per expert-data group; use "
         "AdamW, or ep_size 1", name="muon_experts"),
    Rule("{block} with ep_size {expert} and tensor parallelism (tensor {tensor})",
         "expert > 1 with tensor > 1 for MoE blocks that cannot share expert slots (AutoEP's)",
         lambda d: d.experts_unsplit_by_tensor and d.expert > 1 and d.tensor > 1,
         "not implemented yet (DeepSpeed's MoE layer is; or use ep_size 1)", name="experts_tensor"),
    Rule("activation_checkpointing.partition_activations with Megatron sequence parallelism (parameters marked "
         "sequence_parallel=True, e.g. GPTConfig(sequence_parallel=True))",
         "partition_activations with Megatron sequence parallelism (tensor > 1)",
         lambda d: d.partition_activations and d.sequence_parallel_params and d.tensor > 1,
         "the checkpointed inputs are already cut over the tensor ranks. Use one of them",
         name="partition_activations_sequence_parallel"),
    Rule("data_efficiency.data_sampling.curriculum_learning: curriculum data sampling with model, pipeline or "
         "sequence parallelism (data-parallel size {data} of {world_size} ranks)",
         "curriculum data sampling with pipe, tensor or sequence > 1",
         lambda d: d.curriculum_sampling and d.pipe * d.tensor * d.sequence > 1,
         "each data-parallel rank samples its own share of the curriculum; ranks holding pieces of one model "
         "would need the same samples", name="curriculum_model_parallel"),
)


_TABLE_WHY = ("ZeroOneAdam's local steps move each rank's whole momentum apart between synchronisations; "
              "OneBitLamb's trust ratios need whole-tensor norms; at stage 1 a rank keeps 1/N of them")


def combination_table() -> str:
    """The refused combinations as a Markdown table (docs/engine.md holds a copy; a test compares)."""
    rows = ["| refused combination | why |", "|---|---|"]
    rows += [f"| {rule.table} | {rule.why if isinstance(rule.why, str) else _TABLE_WHY} |" for rule in RULES]
    return "\n".join(rows)
