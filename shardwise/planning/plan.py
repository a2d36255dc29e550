"""``make_plan``: a run of W ranks laid out, cut and costed in one process, with the engine's own code.

The world is torch's fake process-group backend (``FakeStore`` + backend ``"fake"``): this process is
rank 0 of W and every collective returns at once. On it the plan

* builds the ``ParallelDims`` and the grid through ``runtime/plan.py``'s ``plan_grid`` (or, for
  pipeline stages, the ``PipelineModule``'s topology), so every process group of every rank is created
  as the engine creates them, and a layout the engine refuses is refused with the engine's message;
* builds the model on the meta device: the reference GPT from its own tensor-parallel layers under the
  grid (a ``PipelineModule`` for pipeline stages, whose ``parts`` are the engine's partition), a Hugging
  Face model through ``transformers`` with AutoTP's own module replacement;
* lays each rank's parameters out with the ZeRO stage's own flat-buffer arithmetic
  (``zero/flat.py``'s ``FlatGroup`` and bucket sizes at stages 1-2, per-parameter chunks at stage 3),
  which gives the bytes ``engine.memory_breakdown()`` reports and the messages the comms logger counts.

Figures are per rank: ranks of the same pipeline stage differ only in the padding of their ZeRO
partition, and the plan computes each rank it is asked for (``ranks``: all of them, or a sample).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch

from shardwise.planning.model import ModelShape, build_hf_meta, gpt_shape, hf_shape, parse_model_arg

GIB = 1024 ** 3
AXES = ("data", "tensor", "pipe", "sequence", "expert")
_STATE_BYTES = {"adam": 8, "adamw": 8, "fusedadam": 8, "cpuadam": 8, "deepspeedcpuadam": 8, "lamb": 8,
                "fusedlamb": 8, "lion": 4, "adagrad": 4, "rmsprop": 4, "muon": 4}


class PlanError(ValueError):
    """A layout that cannot run (the engine's message), or a rank over ``--gpu_memory``."""


@dataclass
class RankPlan:
    rank: int
    coord: dict
    node: int
    parameters: int  # this rank's piece of the model (its stage, its tensor shard; experts local)
    params_bytes: int
    grads_bytes: int
    master_bytes: int
    optimizer_bytes: int
    offloaded_bytes: int  # of the above, what offload keeps in host memory (or on NVMe)
    activation_bytes_per_micro_batch: int
    activation_bytes_peak: int  # micro-batches in flight on this stage (1F1B) x per micro-batch
    comm_bytes: dict  # axis -> bytes per step (comms-logger convention: the whole message)
    comm_ops: dict  # op -> bytes per step
    wire_bytes: dict  # axis -> bytes this rank's links carry per step (nccl-tests bus factors)
    group_bytes: dict = field(default_factory=dict)  # group -> bytes per step: the axes, ZeRO++'s node, inter_node
    cross_node_bytes: int = 0  # bytes per step this rank receives from other nodes (the comms logger's count)
    hpz_secondary_bytes: int = 0  # ZeRO++ hpZ: the node-local secondary partition of the weights
    loco_error_bytes: int = 0  # ZeRO++ qgZ with LoCo: the error-feedback buffers

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_bytes + \
            self.hpz_secondary_bytes + self.loco_error_bytes

    @property
    def device_bytes(self) -> int:
        return self.model_states_bytes - self.offloaded_bytes + self.activation_bytes_peak

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(model_states_bytes=self.model_states_bytes, device_bytes=self.device_bytes)
        return d


@dataclass
class Plan:
    world: int
    gpus_per_node: int
    dims: object  # ParallelDims
    shape: ModelShape
    parameters: int
    ranks: list[RankPlan]
    pipeline: dict
    checkpoint: dict
    batch: dict
    precision: str
    group_count: int
    group_seconds: float
    seconds: float = 0.0
    gpu_memory: int | None = None
    over_limit: list[int] = field(default_factory=list)
    zeropp: dict | None = None  # the ZeRO++ parts on, and the node layout of their groups

    def largest(self, key) -> RankPlan:
        return max(self.ranks, key=key)

    def as_dict(self) -> dict:
        states = self.largest(lambda r: r.model_states_bytes)
        acts = self.largest(lambda r: r.activation_bytes_peak)
        busiest = self.largest(lambda r: sum(r.comm_bytes.values()))
        return {
            "world": self.world, "gpus_per_node": self.gpus_per_node, "nodes": -(-self.world // self.gpus_per_node),
            "layout": {a: getattr(self.dims, a) for a in AXES} | {"zero_stage": self.dims.zero_stage,
                                                                   "node_size": self.dims.node_size},
            "model": self.shape.__dict__, "precision": self.precision, "batch": self.batch,
            "parameters": self.parameters,
            "model_states_bytes_per_rank": states.model_states_bytes,
            "model_states_rank": states.rank,
            "activation_bytes_per_rank": acts.activation_bytes_peak,
            "activation_bytes_per_micro_batch": acts.activation_bytes_per_micro_batch,
            "comm_bytes_per_step_per_rank": dict(busiest.comm_bytes),
            "wire_bytes_per_step_per_rank": dict(busiest.wire_bytes),
            "group_bytes_per_step_per_rank": dict(busiest.group_bytes),
            "cross_node_bytes_per_step_per_rank": max(r.cross_node_bytes for r in self.ranks),
            "zeropp": self.zeropp,
            "pipeline": self.pipeline, "checkpoint": self.checkpoint,
            "process_groups": self.group_count, "group_creation_seconds": self.group_seconds,
            "gpu_memory": self.gpu_memory, "over_limit": self.over_limit,
            "ranks": [r.as_dict() for r in self.ranks],
            "seconds": self.seconds,
        }


# -- the fake world --------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_world(world: int):
    """This process as rank 0 of ``world`` over torch's fake backend; the group destroyed on exit."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardwise import comm

    if dist.is_initialized():
        raise PlanError("a plan runs in a process of its own: torch.distributed is already initialised here")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        comm.destroy_process_group()


class _GroupCounter:
    """Counts ``torch.distributed.new_group`` calls (every group of every rank is created on each rank)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def counting(self):
        import torch.distributed as dist

        real = dist.new_group

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        dist.new_group = counted
        try:
            yield self
        finally:
            dist.new_group = real


# -- layout -------------------------------------------------------------------------------------------
def build_grid(cfg, *, world: int, pipe: int, kind: str, gpus_per_node: int | None = None):
    """``(grid, dims)`` as ``initialize`` makes them (collective: creates every group), with ZeRO++'s nodes of
    ``gpus_per_node`` ranks (without hpZ; the engine takes the launcher's ranks per node)."""
    from shardwise.parallel_dims import ParallelDims
    from shardwise.runtime import plan as engine_plan
    from shardwise.topology import ParallelGrid, ProcessTopology

    features = engine_plan.config_features(cfg, ranks_per_node=gpus_per_node)
    tp = max(1, cfg.tensor_parallel.autotp_size)
    sp = max(1, cfg.sequence_parallel_size)
    if pipe > 1:
        if kind != "gpt":
            raise PlanError("--pipe needs a PipelineModule: pipeline stages are planned for the reference GPT "
                            "(--model gpt:...); a Hugging Face model trains with data, tensor, sequence and "
                            "expert parallelism")
        if sp > 1:
            raise PlanError("--pipe with sequence_parallel_size > 1 is not planned")
        topology = ProcessTopology.for_world(world, pipe=pipe, model=tp)  # its error: sizes not dividing
        sizes = ParallelDims(pipe=pipe, data=topology.get_dim("data"), tensor=tp)
        dims = engine_plan._requested(sizes, tensor=tp, sequence=sp, features=features).validate(world)
        return ParallelGrid.from_dims(dims, topology=topology), dims  # (the PipelineModule's layout)
    if sp > 1:  # the groups register_with_transformers makes: (data, sequence) or (pipe, data, sequence, model)
        if world % (sp * tp):
            raise PlanError(f"sequence_parallel_size {sp} x tensor_parallel.autotp_size {tp} does not divide the "
                            f"world size {world}")
        dims = ParallelDims(data=world // (sp * tp), tensor=tp, sequence=sp, **features).validate(world)
        return ParallelGrid.from_dims(dims), dims
    return engine_plan.plan_grid(cfg, ranks_per_node=gpus_per_node)


# -- the model, per pipeline stage ------------------------------------------------------------------------
@dataclass
class StageModel:
    named_params: list  # [(name, meta Parameter)] in the order the engine sees them
    layers: int  # transformer blocks on this stage
    first: bool
    last: bool
    module: torch.nn.Module  # the stage's modules (ZeRO-3 cuts them into units)


def build_stages(kind: str, model_cfg, *, grid, dims, partition_method: str, cfg=None) -> tuple[list[StageModel], int]:
    """Each pipeline stage's parameters on the meta device, and the whole model's parameter count."""
    if kind == "gpt":
        from shardwise.models.gpt import GPT, GPTBlock, gpt_pipeline_module

        if dims.pipe == 1:
            with grid.active(), torch.device("meta"):
                model = GPT(model_cfg)
            blocks = sum(isinstance(m, GPTBlock) for m in model.modules())
            return [StageModel(list(model.named_parameters()), blocks, True, True, model)], _whole(model, dims.tensor)
        from shardwise.pipe.module import LayerSpec, PipelineError

        with grid.active(), torch.device("meta"):
            try:
                pm = gpt_pipeline_module(model_cfg, topology=grid.topology, partition_method=partition_method)
            except PipelineError as exc:
                raise PlanError(str(exc)) from None
            stages, whole = [], 0
            for s in range(dims.pipe):
                lo, hi = pm.parts[s], pm.parts[s + 1]
                mods = torch.nn.ModuleDict()
                blocks = 0
                for idx in range(lo, hi):
                    spec = pm._layer_specs[idx]
                    layer = spec.build() if isinstance(spec, LayerSpec) else spec
                    if isinstance(layer, torch.nn.Module):
                        mods[str(idx)] = layer
                        blocks += isinstance(layer, GPTBlock)
                stages.append(StageModel(list(mods.named_parameters()), blocks, s == 0, s == dims.pipe - 1, mods))
                whole += _whole(mods, dims.tensor)
        return stages, whole
    model = build_hf_meta(model_cfg)
    whole = sum(p.numel() for p in model.parameters())
    if dims.expert > 1:
        _place_experts(model, cfg, dims, grid)
    if dims.tensor > 1:
        from shardwise.tensor_parallel.autotp import AutoTP, check_head_counts

        check_head_counts(model, dims.tensor)  # the engine's error for heads not divisible by the tensor size
        AutoTP(model, grid.get_tensor_model_parallel_group(), tp_size=dims.tensor, tp_rank=0)._replace_module(model)
    layers = int(model.config.get_text_config().num_hidden_layers)
    return [StageModel(list(model.named_parameters()), layers, True, True, model)], whole


def _whole(module, tp: int) -> int:
    return sum(p.numel() * (tp if getattr(p, "tensor_model_parallel", False) else 1) for p in module.parameters())


def _place_experts(model, cfg, dims, grid) -> None:
    """AutoEP's own size checks (``moe/autoep/replace.py``: ep must divide the data axis and every MoE
    block's experts) and its own replacement: each rank's blocks keep num_experts / ep experts, whose
    parameters are marked as expert parameters of the grid's ``ep_size_<ep>`` groups."""
    from shardwise.moe.autoep.replace import apply_autoep, check_sizes

    blocks = check_sizes(model, cfg.expert_parallel, data_size=dims.data * dims.sequence)
    if not blocks:
        raise PlanError(f"expert_parallel.autoep_size {dims.expert}: AutoEP finds no MoE block in "
                        f"{type(model).__name__}")
    with grid.active():
        apply_autoep(model, cfg.expert_parallel)


# -- ZeRO arithmetic (the strategies' own layout) ----------------------------------------------------------
def _itemsize(dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _numel(p) -> int:
    return p.numel()


def _is_expert(p) -> bool:
    from shardwise.moe.utils import is_moe_param

    return is_moe_param(p)


@dataclass
class Layout:
    """This rank's model states and the data-axis messages of one step."""

    params: int
    grads: int
    master: int
    optimizer: int
    offloaded: int
    ops: dict  # (group, op) -> bytes per step: the data axis ("data"), ZeRO++'s "node" and "inter_node" groups
    hpz_secondary: int = 0  # ZeRO++ hpZ: the node-local secondary partition of the weights
    loco_errors: int = 0  # ZeRO++ qgZ with LoCo: the error-feedback buffers


@dataclass(frozen=True)
class ZeroPP:
    """What of ZeRO++ the config turns on (stage 3), and the grid's node layout: ``local`` data ranks on each
    node (its ``node`` group) and ``nodes`` nodes (its ``inter_node`` group)."""

    quantized_weights: bool = False
    hpz: int = 1
    quantized_gradients: bool = False
    local: int = 1
    nodes: int = 1
    loco: bool = False  # zeropp_loco_param with qgZ: LoCo's error buffers

    @classmethod
    def of(cls, zc, grid) -> "ZeroPP | None":
        if int(zc.stage) != 3:
            return None
        qw, hpz, qg = bool(zc.zero_quantized_weights), int(zc.zero_hpz_partition_size or 1), bool(
            zc.zero_quantized_gradients)
        if not (qw or hpz > 1 or qg):
            return None
        local = nodes = 1
        if grid.node_size > 0:
            made = grid.node_groups()
            local, nodes = made.size, made.nodes
        return cls(qw, hpz, qg, local, nodes, loco=qg and zc.zeropp_loco_param is not None)


def zero_layout(named_params, *, stage: int, n: int, rank: int, precision, zc, state_bytes: int,
                gas: int, module=None, ep: int = 1, zeropp: ZeroPP | None = None) -> Layout:
    """Bytes of params, grads, fp32 masters and optimizer states on data-parallel rank ``rank`` of ``n``,
    and the bytes its ZeRO stage sends per step of ``gas`` micro-batches (the comms logger's sizes).

    With expert parallelism (``ep`` > 1) the expert parameters are partitioned over their expert-data
    group (``n / ep`` ranks; data rank ``d`` is its ``d // ep``-th, the grid's expert layout, ``topology.py``): at
    stages 1-2 flat buffers of their own (their reduce domain, ``moe/layout.py``), at stage 3 their own chunks.
    ``zeropp``: ZeRO++'s messages and hpZ's secondary partition at stage 3 (``_stage3_ops``)."""
    experts = [(nm, p) for nm, p in named_params if _is_expert(p)] if ep > 1 else []
    if experts and stage in (1, 2):
        dense = [(nm, p) for nm, p in named_params if not _is_expert(p)]
        kw = dict(stage=stage, precision=precision, zc=zc, state_bytes=state_bytes, gas=gas, module=module)
        a = _zero_part(dense, n=n, rank=rank, tag="dense", **kw)
        b = _zero_part(experts, n=n // ep, rank=rank // ep, tag="experts", **kw)
        ops = dict(a.ops)
        for op, v in b.ops.items():
            ops[op] = ops.get(op, 0) + v
        return Layout(a.params + b.params, a.grads + b.grads, a.master + b.master, a.optimizer + b.optimizer,
                      a.offloaded + b.offloaded, ops)
    return _zero_part(named_params, stage=stage, n=n, rank=rank, precision=precision, zc=zc,
                      state_bytes=state_bytes, gas=gas, module=module, tag="all", ep=ep, zeropp=zeropp)


def _zero_part(named_params, *, stage: int, n: int, rank: int, precision, zc, state_bytes: int, gas: int,
               module=None, tag: str = "all", ep: int = 1, zeropp: ZeroPP | None = None) -> Layout:
    b = _itemsize(precision.param_dtype)
    acc = _itemsize(precision.grad_accum_dtype or precision.param_dtype)
    trainable = [(nm, p) for nm, p in named_params if p.requires_grad]
    numels = _cached(module, ("numels",), lambda: {id(p): _numel(p) for p in module.parameters()}) \
        if module is not None else {id(p): _numel(p) for _, p in named_params}
    offload_opt = _offload(zc.offload_optimizer)
    master_on = precision.master_weights or offload_opt != "none"
    if stage == 3:
        def world_of(p):  # an expert parameter is sharded over its expert-data group
            return n // ep if ep > 1 and _is_expert(p) else n

        chunks = [(numels[id(p)], -(-numels[id(p)] // world_of(p)), p.requires_grad, rank // (n // world_of(p)))
                  for _, p in named_params]
        shard = sum(c for _, c, _, _ in chunks)
        owned = 0
        for numel, c, trains, r in chunks:  # this rank's piece of each parameter (the last ones are short)
            if trains:
                start = min(r * c, numel)
                piece = min(start + c, numel) - start
                owned += piece if piece > 1 else 0
        params, grads = shard * b, shard * acc
        master = shard * 4 if (master_on or _offload(zc.offload_param) != "none") else 0
        optimizer = owned * state_bytes
        offloaded = (master + optimizer if offload_opt != "none" else 0) + \
                    (params if _offload(zc.offload_param) != "none" else 0)
        ops, secondary, loco = {}, 0, 0
        if n > 1 and module is not None:
            ops, secondary, loco = _cached(module, ("z3ops", n, gas, b, acc, ep, zeropp),
                                           lambda: _stage3_ops(module, numels, n, zc, gas, b, acc, ep=ep,
                                                               zeropp=zeropp))
        return Layout(params, grads, master, optimizer, offloaded, dict(ops), secondary, loco)
    return _flat_layout(named_params, trainable, numels, stage=stage, n=n, rank=rank, zc=zc, b=b, acc=acc,
                        master_on=master_on, precision=precision, offload_opt=offload_opt,
                        state_bytes=state_bytes, gas=gas, module=module, tag=tag)


def _stage3_ops(module, numels, n, zc, gas, b, acc, *, ep: int = 1, zeropp: ZeroPP | None = None):
    """Stage 3's messages per step, ``({(group, op): bytes}, hpZ secondary bytes, LoCo error bytes)``: each unit
    all-gathered whole (padded), its gradients reduce-scattered; with ZeRO++ (``zero/zeropp.py``,
    ``comm/quantize.py``), on the units sharded over the data axis (not expert units):

    * qwZ: a gather sends each rank's shard as int8 values padded to whole blocks of
      ``weight_block_size(shard)`` elements, and one fp32 scale per block (two all-gathers);
    * hpZ: the backward gather all-gathers the secondary shards, ``ceil(unit / k)`` elements of the working
      dtype each, inside the node (``node`` group); those shards stay allocated (the secondary bytes);
    * qgZ: the reduce-scatter becomes all-to-alls of int8 codes inside the node (``L x M`` rows of the shard),
      then of int4 codes (two a byte) across nodes (``M`` rows; ``L`` data ranks on each of ``M`` nodes), with
      an fp32 scale per block, the row laid out as ``zero/qgz.py`` lays it out (``_qgz_messages``)."""
    from shardwise.comm import quantize as q

    ops: dict = {}
    secondary = loco = 0

    def add(group, op, nbytes):
        ops[(group, op)] = ops.get((group, op), 0) + nbytes

    def gather(group, shard, times, quantized):
        if quantized:  # QuantizedGather: the int8 values and the fp32 scales, each rank's padded to whole blocks
            block = q.weight_block_size(shard)
            padded = q.padded_numel(shard, block)
            add(group, "all_gather_into_tensor", times * n * padded)
            add(group, "all_gather_into_tensor", times * n * (padded // block) * 4)
        else:
            add(group, "all_gather_into_tensor", times * shard * n * b)

    pp = zeropp
    units = stage3_units(module, int(zc.stage3_prefetch_bucket_size))
    threshold = int(zc.stage3_param_persistence_threshold)
    for unit in units:
        shard = sum(-(-numels[id(p)] // n) for p in unit)
        on = pp is not None and not (ep > 1 and any(_is_expert(p) for p in unit))  # (expert units: plain ZeRO-3)
        persistent = all(numels[id(p)] <= threshold for p in unit)
        # a unit holding the whole model, or a persistent one (every parameter at most
        # stage3_param_persistence_threshold), stays gathered from forward to backward: once per
        # micro-batch; the others are gathered for forward and again for backward
        again = not (persistent or len(units) == 1)
        gather("data", shard, gas, on and pp.quantized_weights)
        hpz = on and pp.hpz > 1
        if hpz:  # the secondary partition of the unit over the node's data ranks
            piece = -(-sum(numels[id(p)] for p in unit) // pp.local)
            secondary += piece * b
        if again and hpz:
            add("node", "all_gather_into_tensor", gas * piece * pp.local * b)
        elif again:
            gather("data", shard, gas, on and pp.quantized_weights)
        if not any(p.requires_grad for p in unit):
            continue
        if on and pp.quantized_gradients:  # the whole bucket: the unit's shard of every rank
            for group, nbytes in _qgz_messages(unit, numels, n, acc, pp):
                add(group, "all_to_all_single", gas * nbytes)
            if pp.loco:
                loco += _loco_bytes(unit, numels, n, pp)
        else:
            add("data", "reduce_scatter_tensor", gas * sum(-(-numels[id(p)] // n) * n for p in unit
                                                           if p.requires_grad) * acc)
    return ops, secondary, loco


def _loco_bytes(unit, numels, n, pp) -> int:
    """LoCo's error buffers of one unit's gradient bucket (``zero/qgz.py``'s ``_ErrorFeedback``): for the hop
    inside the node all ``n`` ranks' rows, for the hop across nodes this rank's ``M`` partial rows, each hop's
    when its group has more than one rank; a row is int8 codes, one per element, and an fp32 scale per block."""
    layout = _qgz_layout(unit, numels, n)
    rows = (n if pp.local > 1 else 0) + (pp.nodes if pp.nodes > 1 else 0)
    return rows * (layout.width + 4 * len(layout.blocks))


def _qgz_messages(unit, numels, n, acc, pp) -> list:
    """``[(group, bytes)]``: the all-to-alls of qgZ's reduce-scatter of one unit's gradient bucket (a row per
    rank: this rank's shard of the unit), ``L x M`` rows inside the node, then ``M`` rows across nodes, each
    stage when its group has more than one rank. A row is laid out as ``zero/qgz.py`` lays it out
    (``RowLayout``): the whole row's codes (int8 inside the node, int4 across), an fp32 scale a block, and the
    pieces DeepSpeed does not quantize again at full precision, in one message."""
    from shardwise.zero import qgz

    stages = [(g, rows, bits) for g, rows, size, bits in (("node", pp.local * pp.nodes, pp.local, qgz.INTRA_BITS),
                                                           ("inter_node", pp.nodes, pp.nodes, qgz.INTER_BITS))
              if size > 1]
    layout = _qgz_layout(unit, numels, n)
    return [(g, rows * layout.wire_bytes(acc, bits)) for g, rows, bits in stages]


def _qgz_layout(unit, numels, n):
    """The ``qgz.RowLayout`` of one unit's gradient bucket row (this rank's shard of each parameter)."""
    from shardwise.zero import qgz

    return qgz.RowLayout.of([(-(-numels[id(p)] // n), tuple(p.shape), p.requires_grad) for p in unit], n)


def _flat_layout(named_params, trainable, numels, *, stage, n, rank, zc, b, acc, master_on, precision, offload_opt,
                 state_bytes, gas, module=None, tag="all") -> Layout:
    from shardwise.zero.flat import group_by_dtype
    from shardwise.zero.stage12 import Stage2Strategy

    frozen = sum(numels[id(p)] for _, p in named_params if not p.requires_grad) * b
    ops: dict = {}

    def add(op, nbytes):
        ops[("data", op)] = ops.get(("data", op), 0) + nbytes

    world = n if stage in (1, 2) else 1
    bucket = int(zc.reduce_bucket_size)
    if stage == 2 and "reduce_bucket_size" not in zc.model_fields_set:
        total = sum(numels[id(p)] for _, p in trainable)
        bucket = min(bucket, max(Stage2Strategy.min_bucket_elements, -(-total // Stage2Strategy.min_buckets)))
    def cut():  # the strategy's own layout: reversed trainable parameters, one flat group per dtype
        return group_by_dtype(list(reversed(trainable)), world_size=world, bucket_elements=bucket) if trainable else []

    groups = _cached(module, ("flat", tag, world, bucket), cut) if module is not None else cut()
    padded = sum(g.padded_numel for g in groups)
    part = sum(g.partition_numel for g in groups)
    owned = 0
    for g in groups:
        for a, c in g.rank_chunks(rank if stage else 0):
            owned += sum(f.param_end - f.param_start for f in g.fragments(a, c) if f.param_end - f.param_start > 1)
    params = padded * b + frozen
    if stage == 0:
        grads, master = padded * acc, (padded * 4 if precision.master_weights else 0)
        optimizer = owned * state_bytes
        offloaded = 0
        if n > 1:
            for g in groups:
                for s, e in g.buckets:
                    add("all_reduce", (e - s) * acc)
        return Layout(params, grads, master, optimizer, offloaded, ops)
    grads = padded * acc if stage == 1 else part * acc
    master = part * 4 if master_on else 0
    optimizer = owned * state_bytes
    offloaded = master + optimizer if offload_opt != "none" else 0
    if n > 1:
        times = gas if stage == 2 else 1
        for g in groups:
            for s, e in g.buckets:
                add("reduce_scatter_tensor", times * (e - s) * acc)
                add("all_gather_into_tensor", (e - s) * b)
    return Layout(params, grads, master, optimizer, offloaded, ops)


def stage3_units(module: torch.nn.Module, unit_elements: int) -> list[list]:
    """The parameter lists of ZeRO-3's gather units, cut as ``zero/stage3.py``'s ``_build_units`` cuts them
    (a module whose subtree fits ``stage3_prefetch_bucket_size`` elements is one unit; a bigger one or a
    container keeps its direct parameters and its children are cut the same way)."""
    owner: set = set()
    units: list = []

    def fresh(params):
        out = []
        for p in params:
            if id(p) not in owner:
                owner.add(id(p))
                out.append(p)
        return out

    def visit(m):
        subtree = [p for p in m.parameters() if id(p) not in owner]
        container = isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
        fits = sum(_numel(p) for p in subtree) <= unit_elements and not container
        if fits or not any(True for _ in m.children()):
            part = fresh(subtree)
            if part:
                units.append(part)
            return
        part = fresh(p for p in m._parameters.values() if p is not None)
        if part:
            units.append(part)
        for child in m.children():
            visit(child)

    visit(module)
    return units


def _cached(module, key, compute):
    """Per-module memo (a stage's modules are walked once, not once per rank)."""
    memo = module.__dict__.setdefault("_plan_memo", {})
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _offload(block) -> str:
    return getattr(block, "device", "none") if block is not None else "none"


def optimizer_state_bytes(cfg) -> int:
    if cfg.optimizer is None:
        return 0
    kind = cfg.optimizer.type.lower()
    if kind == "sgd":
        return 4 if (cfg.optimizer.params or {}).get("momentum", 0) else 0
    return _STATE_BYTES.get(kind, 8)


# -- activations ----------------------------------------------------------------------------------------
def activation_bytes(shape: ModelShape, *, micro_batch: int, layers: int, tp: int, sp: int, bytes_per_value: int,
                     checkpointing: bool, first: bool, last: bool) -> int:
    """Korthikanti et al. (2022) per layer, ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` bytes in 16-bit (scaled for
    fp32), with the sequence cut over ``sp`` ranks; full checkpointing keeps each layer's input
    (``2*s*b*h``) plus one layer being recomputed. The last stage adds its logits (fp32 for the loss)."""
    s, b, h, a = shape.seq_len // max(sp, 1), micro_batch, shape.hidden, shape.heads
    scale = bytes_per_value / 2
    per_layer = s * b * h * (10 + 24 / tp + 5 * a * shape.seq_len / (h * tp)) * scale
    if checkpointing:
        total = layers * 2 * s * b * h * scale + (per_layer if layers else 0)
    else:
        total = layers * per_layer
    if last:
        total += s * b * (shape.vocab // tp) * 4
    if first:
        total += s * b * h * bytes_per_value
    return int(total)


# -- the plan --------------------------------------------------------------------------------------------------
def make_plan(*, world: int, gpus_per_node: int, model: str, config, gpu_memory: int | None = None,
              ranks: list[int] | None = None, pipe: int = 1, seq_len: int | None = None,
              activation_checkpointing: bool | None = None, partition_method: str = "parameters") -> Plan:
    """Lay out, cut and cost a run of ``world`` ranks (see the module docstring). ``ranks``: the ranks to
    report (default: all up to 4,096, else one rank per pipeline stage and node boundary)."""
    from shardwise.config import load_config
    from shardwise.precision import PrecisionPolicy

    start = time.perf_counter()
    if world < 1 or gpus_per_node < 1:
        raise PlanError(f"--world and --gpus_per_node must be >= 1, got {world} and {gpus_per_node}")
    if world % gpus_per_node:
        raise PlanError(f"--world {world} is not a whole number of nodes of --gpus_per_node {gpus_per_node}")
    cfg = load_config(config)
    kind, model_cfg = parse_model_arg(model)
    shape = gpt_shape(model_cfg, seq_len) if kind == "gpt" else hf_shape(model_cfg, seq_len)
    precision = PrecisionPolicy.from_config(cfg)
    counter = _GroupCounter()
    with fake_world(world):
        t = time.perf_counter()
        with counter.counting():
            grid, dims = build_grid(cfg, world=world, pipe=pipe, kind=kind, gpus_per_node=gpus_per_node)
        group_seconds = time.perf_counter() - t
        batch = cfg.resolve_batch_sizes(dims.data)
        stages, whole = build_stages(kind, model_cfg, grid=grid, dims=dims, partition_method=partition_method,
                                     cfg=cfg)
        topo = grid.topology
        chosen = _choose_ranks(ranks, world, topo, dims, gpus_per_node)
        ckpt = activation_checkpointing if activation_checkpointing is not None else \
            bool(cfg.activation_checkpointing is not None and "activation_checkpointing" in cfg.model_fields_set)
        state_bytes = optimizer_state_bytes(cfg)
        zc = cfg.zero_optimization
        gas, micro = batch.gradient_accumulation_steps, batch.train_micro_batch_size_per_gpu
        n = dims.data * dims.sequence
        stage = int(zc.stage)
        b = _itemsize(precision.param_dtype)
        layouts: dict = {}
        rank_plans = []
        zeropp = ZeroPP.of(zc, grid)
        groups = _RankGroups(grid, dims)
        for r in chosen:
            coord = topo.get_coord(r)
            s = coord.get("pipe", 0)
            dp_rank = coord.get("data", 0) * dims.sequence + coord.get("sequence", 0)
            st = stages[s]
            key = (s, dp_rank)
            if key not in layouts:
                layouts[key] = zero_layout(st.named_params, stage=stage, n=n, rank=dp_rank, precision=precision,
                                           zc=zc, state_bytes=state_bytes, gas=gas, module=st.module,
                                           ep=dims.expert, zeropp=zeropp)
            lay = layouts[key]
            act = activation_bytes(shape, micro_batch=micro, layers=st.layers, tp=dims.tensor, sp=dims.sequence,
                                   bytes_per_value=b, checkpointing=ckpt, first=st.first, last=st.last)
            in_flight = min(dims.pipe - s, gas) if dims.pipe > 1 else 1
            comm_bytes, comm_ops, wire, by_group, ops = _comm(lay, shape=shape, dims=dims, stage_model=st,
                                                              micro=micro, gas=gas, b=b, zero_stage=stage,
                                                              zeropp=zeropp)
            rank_plans.append(RankPlan(
                rank=r, coord={a: coord.get(a, 0) for a in topo.axes}, node=r // gpus_per_node,
                parameters=_cached(st.module, ("parameters",), lambda: sum(_numel(p) for _, p in st.named_params)),
                params_bytes=lay.params,
                grads_bytes=lay.grads, master_bytes=lay.master, optimizer_bytes=lay.optimizer,
                offloaded_bytes=lay.offloaded, activation_bytes_per_micro_batch=act,
                activation_bytes_peak=act * in_flight, comm_bytes=comm_bytes, comm_ops=comm_ops, wire_bytes=wire,
                group_bytes=by_group, hpz_secondary_bytes=lay.hpz_secondary, loco_error_bytes=lay.loco_errors,
                cross_node_bytes=cross_node_bytes(ops, rank=r, gpus_per_node=gpus_per_node, groups=groups,
                                                  stage_model=st)))
    pipeline = _pipeline_report(stages, dims, gas)
    plan = Plan(world=world, gpus_per_node=gpus_per_node, dims=dims, shape=shape, parameters=whole, ranks=rank_plans,
                pipeline=pipeline, checkpoint=_checkpoint_report(rank_plans, stages, dims, whole, b, world, stage,
                                                                  precision),
                batch=batch._asdict(), precision={torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
                    precision.param_dtype, "fp32"), group_count=counter.count, group_seconds=group_seconds,
                gpu_memory=gpu_memory, zeropp=None if zeropp is None else dict(zeropp.__dict__))
    if gpu_memory:
        plan.over_limit = [r.rank for r in rank_plans if r.device_bytes > gpu_memory]
    plan.seconds = time.perf_counter() - start
    return plan


def _choose_ranks(ranks, world, topo, dims, gpus_per_node) -> list[int]:
    if ranks:
        bad = [r for r in ranks if not 0 <= r < world]
        if bad:
            raise PlanError(f"--ranks {bad}: ranks run from 0 to {world - 1}")
        return sorted(set(ranks))
    if world <= 4096:
        return list(range(world))
    # a sample: the first and last rank of every pipeline stage, and of the first and last node
    picked = {0, world - 1, gpus_per_node - 1, world - gpus_per_node}
    for s in range(dims.pipe):
        members = topo.get_axis_list("pipe", s) if "pipe" in topo.axes else list(range(world))
        picked.update((members[0], members[-1]))
    return sorted(r for r in picked if 0 <= r < world)


def _comm(lay: Layout, *, shape, dims, stage_model, micro, gas, b, zero_stage, zeropp: ZeroPP | None = None):
    """Bytes per step by axis (comms-logger message sizes), by op, what the links carry, by group (the axes,
    and ZeRO++'s ``node`` and ``inter_node`` groups, which are counted on the data axis too), and
    ``{(group, op): bytes}``."""
    from shardwise.comm.logger import bus_factor

    ops = dict(lay.ops)
    n = dims.data * dims.sequence
    # the clipped step's one all-reduce of the squared gradient norm (train_step.norm_scope)
    if dims.pipe * dims.tensor > 1:
        ops[("tensor" if dims.pipe == 1 else "pipe", "all_reduce")] = 4
    elif zero_stage > 0 and n > 1:
        ops[("data", "all_reduce")] = ops.get(("data", "all_reduce"), 0) + 4
    s_local = shape.seq_len // dims.sequence
    act = micro * s_local * shape.hidden * b
    if dims.tensor > 1:  # each column-parallel layer's input gradient, each row-parallel output, the embedding
        per_mb = _cached(stage_model.module, ("tp",), lambda: tensor_parallel_reductions(stage_model.module)) * act
        if stage_model.last and shape.kind == "gpt":  # vocab-parallel cross entropy: max, sum of exps, target logit (fp32 [b, s])
            per_mb += 3 * micro * s_local * 4
        ops[("tensor", "all_reduce")] = ops.get(("tensor", "all_reduce"), 0) + gas * per_mb
        # a column-parallel layer with gather_output (a tp_plan's LM head) all-gathers its whole output forward
        gathered = _cached(stage_model.module, ("tp_gathered",), lambda: tensor_parallel_gathered_features(
            stage_model.module))
        if gathered:
            key = ("tensor", "all_gather_into_tensor")
            ops[key] = ops.get(key, 0) + gas * micro * s_local * gathered * b
    if dims.pipe > 1:  # pipe/engine.py: the batch-loading agreement (one fp32 flag per rank of the world)
        # and the loss of each micro-batch averaged over the replicas, both over the world
        ops[("pipe", "all_reduce")] = ops.get(("pipe", "all_reduce"), 0) + 4 * dims.world_size + 4 * gas
    if dims.pipe > 1:  # activations forward, their gradients back, per micro-batch (point to point)
        p2p = gas * act * ((0 if stage_model.last else 1) + (0 if stage_model.first else 1))
        ops[("pipe", "send_recv")] = ops.get(("pipe", "send_recv"), 0) + p2p
    if dims.sequence > 1:  # Ulysses: q, k, v and the output all-to-all forward, again backward
        ops[("sequence", "all_to_all")] = gas * stage_model.layers * 8 * act
    if dims.expert > 1 and shape.num_experts:  # dispatch and combine, forward and backward
        k = max(shape.experts_per_token, 1)
        ops[("expert", "all_to_all")] = gas * stage_model.layers * 4 * act * k
    by_axis = {a: 0 for a in AXES}
    by_op: dict = {}
    by_group: dict = {}
    wire = {a: 0 for a in AXES}
    size = {"data": n, "tensor": dims.tensor, "pipe": dims.pipe, "sequence": dims.sequence, "expert": dims.expert,
            "node": zeropp.local if zeropp else 1, "inter_node": zeropp.nodes if zeropp else 1}
    for (group, op), v in ops.items():
        axis = GROUP_AXIS.get(group, group)
        by_axis[axis] += v
        by_op[op] = by_op.get(op, 0) + v
        by_group[group] = by_group.get(group, 0) + v
        wire[axis] += int(v * (1.0 if op in ("send_recv", "all_to_all") else bus_factor(op, max(size[group], 2))))
    return by_axis, by_op, wire, by_group, ops


GROUP_AXIS = {"node": "data", "inter_node": "data"}  # ZeRO++'s groups: each data-parallel group cut by node


class _RankGroups:
    """The ranks of each group a rank's messages go over (``_comm``'s group names), from the grid's layout:
    the rank arithmetic of ``rank_layout.py``, once for the whole world."""

    def __init__(self, grid, dims) -> None:
        from shardwise.rank_layout import node_rank_lists, zero_data_ranks

        topo = grid.topology
        self.world = topo.world_size
        self.of: dict = {}
        self._off: dict = {}

        def index(name, lists):
            for ranks in lists:
                ranks = tuple(ranks)
                for r in ranks:
                    self.of[(name, r)] = ranks

        data = zero_data_ranks(topo)
        index("data", data)
        if dims.node_size > 0:
            for ranks in data:
                local, cross = node_rank_lists(ranks, dims.node_size)
                index("node", local)
                index("inter_node", cross)
        for group, axis in (("tensor", "model"), ("sequence", "sequence")):
            if axis in topo.axes:
                index(group, topo.axis_groups(axis))
        if dims.expert > 1:
            experts = grid.expert_groups(create=False)
            if experts is not None:
                index("expert", [ranks for ep_lists, _ in experts.layout for ranks in ep_lists])
        self.grid = grid

    def ranks(self, group: str, rank: int):
        return self.of.get((group, rank), (rank,))

    def off_node(self, group: str, rank: int, gpus_per_node: int) -> tuple[int, int]:
        """(size of ``rank``'s ``group``, how many of its ranks are on other nodes)."""
        ranks = self.ranks(group, rank)
        me = rank // gpus_per_node
        key = (id(ranks), me)
        if key not in self._off:
            self._off[key] = (len(ranks), sum(1 for r in ranks if r // gpus_per_node != me))
        return self._off[key]


def cross_node_bytes(ops: dict, *, rank: int, gpus_per_node: int, groups: _RankGroups, stage_model=None) -> int:
    """Bytes ``rank`` receives per step from ranks on other nodes (nodes of ``gpus_per_node`` ranks), counted as
    the comms logger's ``cross_node_bytes`` counts them (``comm/logger.py``: S/n from each peer of an all-gather,
    reduce-scatter or all-to-all of S bytes on n ranks, 2S/n of an all-reduce). The pipeline's all-reduces are
    over the whole world; its point-to-point messages come from the neighbouring stages' ranks."""
    from shardwise.comm.logger import _received_off_node

    me = rank // gpus_per_node
    total = 0
    for (group, op), v in ops.items():
        if op == "send_recv":  # one message from the previous stage forward, one from the next backward
            sends = (0 if stage_model.last else 1) + (0 if stage_model.first else 1)
            if not sends:
                continue
            coord = groups.grid.topology.get_coord(rank)._asdict()
            stage = coord.get("pipe", 0)
            others = {a: c for a, c in coord.items() if a != "pipe"}
            peers = ([groups.grid.topology.get_rank(**others, pipe=stage - 1)] if not stage_model.first else []) + \
                    ([groups.grid.topology.get_rank(**others, pipe=stage + 1)] if not stage_model.last else [])
            total += v // sends * sum(1 for p in peers if p // gpus_per_node != me)
            continue
        if group == "pipe":  # (the batch agreement, the loss average, the norm: over the world)
            size = groups.world
            off = size - min(gpus_per_node, size)
        else:
            size, off = groups.off_node(group, rank, gpus_per_node)
        total += _received_off_node(op, v, size, off)
    return total


def tensor_parallel_reductions(module) -> int:
    """All-reduces of one activation per micro-batch on the tensor axis: forward, a row-parallel layer's
    output and a vocab-parallel embedding's; backward, a column-parallel layer's input gradient."""
    from shardwise.tensor_parallel.autotp_layers import LinearAllreduce, LinearLayer
    from shardwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    count = 0
    for m in module.modules():
        if isinstance(m, (ColumnParallelLinear, LinearLayer)):
            count += 1
        elif isinstance(m, (RowParallelLinear, LinearAllreduce, VocabParallelEmbedding)):
            count += 1
    return count


def tensor_parallel_gathered_features(module) -> int:
    """Output features, whole, of the column-parallel layers that all-gather their output (``gather_output``):
    per token, the elements of one forward all-gather each on the tensor axis."""
    from shardwise.tensor_parallel.autotp_layers import LinearLayer
    from shardwise.tensor_parallel.layers import ColumnParallelLinear

    total = 0
    for m in module.modules():
        if isinstance(m, LinearLayer) and m.gather_output and m.tp_world_size > 1:
            total += m.out_features * m.tp_world_size
        elif isinstance(m, ColumnParallelLinear) and m.gather_output and m.world_size > 1:
            total += m.output_size
    return total


def _pipeline_report(stages, dims, gas) -> dict:
    params = [sum(_numel(p) for _, p in st.named_params) for st in stages]
    layers = [st.layers for st in stages]
    mean = sum(params) / len(params)
    p, m = dims.pipe, gas
    return {"stages": dims.pipe, "layers_per_stage": layers, "parameters_per_stage": params,
            "imbalance": (max(params) / mean) if mean else 1.0, "micro_batches": m,
            "bubble_fraction": (p - 1) / (m + p - 1) if p > 1 else 0.0}


def _checkpoint_report(rank_plans, stages, dims, whole, b, world, stage, precision) -> dict:
    """The native layout (checkpoint/engine_io.py): the whole model once, fp32 masters and optimizer state
    per owning rank, RNG state per rank."""
    per_rank = {r.rank: r for r in rank_plans}
    sample = len(per_rank) < world
    owners = world if stage > 0 else dims.pipe * dims.tensor  # stage 0: data rank 0 of each model piece
    mean = lambda key: sum(key(r) for r in rank_plans) / len(rank_plans)  # noqa: E731
    master = int(mean(lambda r: r.master_bytes) * owners) if precision.master_weights else 0
    optim = int(mean(lambda r: r.optimizer_bytes) * owners)
    files = {"manifest.json": 1, "model.safetensors": 1, "extra.safetensors": 1,
             "rank<r>.safetensors": world, "rank<r>.json": world, "optim_rank<r>.safetensors": owners}
    if precision.master_weights:
        files["master_rank<r>.safetensors"] = owners
    return {"files": sum(files.values()), "by_name": files, "model_bytes": whole * b, "master_bytes": master,
            "optimizer_bytes": optim, "total_bytes": whole * b + master + optim,
            "estimated_from_sample": sample}
