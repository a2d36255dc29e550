"""ZeRO stage 3: parameters, gradients and optimizer states all partitioned.

Every parameter is sharded per parameter (``partitioned_param.py``): rank r
keeps chunk r of each one.  The parameters of one module form a unit that is
all-gathered right before the module runs (forward, and again before its
backward) and released after (``coordinator.py``).  A unit's gradients are
packed rank-major and reduce-scattered as soon as the unit's last gradient is
ready; this rank's chunk is added to its gradient partition.  The optimizer
steps fp32 views of the owned chunks (the fp32 master copy in 16-bit
training), and the step writes them back into the shards — no all-gather:
the next forward gathers what it needs.

Gradient bookkeeping, clipping, overflow and the optimizer step are those of
stage 2 (``PartitionedStrategy``), with units in the role of buckets.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from shardwise import comm
from shardwise.param_attrs import external_params, is_z3_leaf, zero_unit
from shardwise.precision import PrecisionPolicy
from shardwise.zero import param_offload as param_offload_view
from shardwise.zero import registry, zeropp
from shardwise.comm import quantize
from shardwise.zero.buckets import Bucket, BucketReducer, PartitionGrads
from shardwise.zero.coordinator import ParamCoordinator, Unit
from shardwise.zero.partitioned_param import gather_full, is_partitioned, owned_range, scatter_full_, shard_param_
from shardwise.zero.partitioned_step import Fragment, PartitionedOptimizer, offload_device
from shardwise.zero.strategy import ReduceSettings, ZeroStrategy


class _UnitBuckets:
    """Presents the trainable parameters of the units as the "group" a ``BucketReducer`` walks:
    one bucket per unit, holding the unit's gradients rank-major (row r goes to rank r)."""

    def __init__(self, units: list[Unit]) -> None:
        self.params, self.buckets, self.bucket_members, self.unit_of_bucket = [], [], [], []
        self.names: list[str] = []
        pos = 0
        for u in units:
            members = []
            for p, name in zip(u.params, u.names):
                if p.requires_grad:
                    members.append(len(self.params))
                    self.params.append(p)
                    self.names.append(name)
            if members:
                size = u.shard_numel * u.world
                self.buckets.append((pos, pos + size))
                self.bucket_members.append(members)
                self.unit_of_bucket.append(u)
                pos += size


class UnitGradients(PartitionGrads):
    """The ``GradientStore`` of stage 3: a unit's gradients are packed rank-major into a short-lived
    bucket as they arrive (``param.grad`` is dropped at once), and this rank's row of the reduced
    bucket is added to the unit's gradient partition."""

    reduce_every_backward = True
    max_in_flight = 2

    def __init__(self, units: list[Unit], *, accum_dtype: torch.dtype | None = None) -> None:
        self.units = units
        self.layout = _UnitBuckets(units)
        # (accum_dtype: data_types.grad_accum_dtype, where the micro-steps accumulate, if not the weights')
        self.partitions = [torch.zeros(u.shard_numel, dtype=accum_dtype or u.dtype, device=u.device) for u in units]
        self._trainable = {u.index: sum(p.requires_grad for p in u.params) for u in units}
        self._accepted = dict.fromkeys(self._trainable, 0)
        self.on_complete = None  # called with a unit when its last trainable gradient of the backward came

    def complete(self, u: Unit) -> bool:
        """Whether every trainable parameter of ``u`` has its gradient of this backward (frozen units: yes)."""
        return self._accepted[u.index] == self._trainable[u.index]

    def begin(self) -> None:
        self._accepted = dict.fromkeys(self._accepted, 0)

    def zero_(self) -> None:
        for buf in self.partitions:
            buf.zero_()
        for u in self.units:
            for p in u.params:
                p.grad = None

    # -- GradientStore ----------------------------------------------------------------------
    def storage(self, b: Bucket) -> torch.Tensor:
        u = self.layout.unit_of_bucket[b.position]
        return torch.zeros(b.numel, dtype=u.dtype, device=u.device)

    def accept(self, b: Bucket, i: int, p: torch.Tensor) -> None:
        u = self.layout.unit_of_bucket[b.position]
        k = u.position_of[id(p)]
        n, off, c = u.numels[k], u.offsets[k], u.chunks[k]
        rows = b.data.view(u.world, u.shard_numel)[:, off : off + c]  # rank-major: row r -> rank r
        grad = p.grad.reshape(-1)
        full = n // c
        rows[:full].copy_(grad[: full * c].view(full, c))
        if full * c < n:  # the last, partial chunk (the rest of the bucket is already zero)
            rows[full, : n - full * c].copy_(grad[full * c :])
        p.grad = None
        self._accepted[u.index] += 1
        if self.on_complete is not None and self.complete(u):
            self.on_complete(u)  # released (with what waited for it) if no use of it is left in this backward

    def reduced(self, b: Bucket, own: torch.Tensor) -> None:
        u = self.layout.unit_of_bucket[b.position]
        self.partitions[u.index].add_(own)
        b.data = None


class AveragedGradients(Mapping):
    """DeepSpeed's ``optimizer.averaged_gradients`` under ZeRO-3, read when asked: ``{0: [...]}``, this rank's
    partition (``ds_tensor``'s layout: ``ceil(numel / world)`` elements, zero-padded) of the reduced gradient of
    each trainable parameter, unit by unit, as accumulated since the last step. One key: DeepSpeed keys them
    by sub-group of the optimizer step, and shardwise steps every partition as one group. Views, not copies."""

    def __init__(self) -> None:
        self.stores: list[UnitGradients] = []  # (MoE: the expert and the non-expert strategies add theirs)

    @classmethod
    def attach(cls, optimizer, store: UnitGradients) -> None:
        view = getattr(optimizer, "averaged_gradients", None)
        if not isinstance(view, cls):
            view = optimizer.averaged_gradients = cls()
        view.stores.append(store)

    def __getitem__(self, key):
        if key != 0:
            raise KeyError(key)
        return [g.partitions[u.index][off : off + c] for g in self.stores for u in g.units
                for p, off, c in zip(u.params, u.offsets, u.chunks) if p.requires_grad]

    def __iter__(self):
        return iter((0,))

    def __len__(self) -> int:
        return 1


class Stage3Strategy(ZeroStrategy):
    stage = 3
    replicated = False
    shards_gradients = True
    shards_parameters = True
    gathers_module_state = True

    def __init__(
        self,
        *,
        module: torch.nn.Module,
        named_params: list[tuple[str, torch.nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        precision: PrecisionPolicy,
        dp_group=None,
        reduce: ReduceSettings = ReduceSettings(),
        zero_config=None,
        aio=None,
        layout=None,
    ) -> None:
        """``layout`` (``zero/layout.py``), if given, says which group each parameter is sharded and reduced
        over (expert parallelism: experts over their expert-data-parallel group), ``dp_group`` otherwise."""
        if layout is not None:
            self.layout = layout
        self.optimizer = optimizer
        self.precision = precision
        self.dp_group = dp_group
        self.world = self.dp_world_size = comm.get_world_size(dp_group)
        self.rank = comm.get_rank(dp_group)
        registry.register(self, named_params)
        if not any(p.requires_grad for _, p in named_params):
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        zc = zero_config
        names = {id(p): n for n, p in named_params}
        group_of = layout.partition_group if layout is not None else (lambda p: dp_group)
        for p in module.parameters():
            if not is_partitioned(p):  # (the engine broadcast rank 0's values already)
                shard_param_(p, group=group_of(p), broadcast=False)
            else:
                _check_partition_group(names.get(id(p), "?"), p, group_of(p))
        unit_elements = int(zc.stage3_prefetch_bucket_size) if zc is not None else 0
        self.units, module_units = _build_units(module, names, unit_elements)
        threshold = int(zc.stage3_param_persistence_threshold) if zc is not None else 0
        for u in self.units:
            u.persistent = all(p.ds_numel <= threshold for p in u.params)
            for p in u.params:
                p.ds_persist = u.persistent
        param_offload = zc.offload_param if zc is not None else None
        self.partition = PartitionedOptimizer(
            optimizer, source=self, partition_of=lambda ui: self.units[ui].shard, fragments=self._fragments(),
            params_of={n: p for u in self.units for n, p in zip(u.names, u.params)},
            laid_out={id(p) for u in self.units for p in u.params},
            # Offloaded shards move (to the CPU or a file): the optimizer must not step views of them.
            separate_master=precision.master_weights or offload_device(param_offload) != "none",
            offload=zc.offload_optimizer if zc is not None else None,
            sub_group_size=int(zc.sub_group_size) if zc is not None else 10**9, aio=aio, dp_group=dp_group)
        for u in self.units:  # 16-bit training: shards hold 16-bit weights, masters fp32
            if u.dtype != precision.param_dtype:
                u.cast_(precision.param_dtype)
        self.param_store = None
        self._offload_params(param_offload, aio)
        self.quantized_store = None  # zero_quantized_nontrainable_weights: frozen units' shards as int8 blocks
        if zc is not None and zc.zero_quantized_nontrainable_weights and self.param_store is None:
            frozen = [u for u in self.units if not any(p.requires_grad for p in u.params)]
            if frozen:
                self.quantized_store = zeropp.QuantizedShardStore()
                for u in frozen:
                    u.offload_to_nvme(self.quantized_store)
        self.gradients = UnitGradients(self.units, accum_dtype=precision.grad_accum_dtype)
        self.zeropp = zeropp.setup(zc, dp_group=dp_group,  # ZeRO++ (qwZ, hpZ, qgZ), None when off
                                   bucket_units=self.gradients.layout.unit_of_bucket)
        self._enable_zeropp()
        self.reducer = BucketReducer([self.gradients.layout], self.gradients, reduce=reduce, dp_group=dp_group,
                                     scatter=True, on_reduced=self._unit_reduced, before_launch=self._before_reduce,
                                     bucket_groups=[u.group for u in self.gradients.layout.unit_of_bucket],
                                     bucket_scales=[self.layout.grad_scale(u.params[0])
                                                    for u in self.gradients.layout.unit_of_bucket],
                                     reduce_scatter=self.zeropp.reducer if self.zeropp is not None else None)
        self.coordinator = ParamCoordinator(
            self.units, module_units, check_group=dp_group,
            prefetch_elements=int(zc.stage3_prefetch_bucket_size) if zc is not None else 0,
            max_live_elements=int(zc.stage3_max_live_parameters) if zc is not None else 10**9,
            reuse_distance=int(zc.stage3_max_reuse_distance) if zc is not None else 10**9,
        )
        self.coordinator.unit_grads_complete = self.gradients.complete
        self.gradients.on_complete = self.coordinator.grads_arrived
        self.parameter_offload = param_offload_view.attach(module, self.coordinator, optimizer)
        if optimizer is not None:
            AveragedGradients.attach(optimizer, self.gradients)

    # -- layout ---------------------------------------------------------------------------
    def _fragments(self) -> list[list[Fragment]]:
        out = []
        for ui, u in enumerate(self.units):
            frags = []
            for p, name, off in zip(u.params, u.names, u.offsets):
                start, end = owned_range(p)
                if p.requires_grad and end > start:
                    frags.append(Fragment(name, ui, start, end, off, off))
            out.append(frags)
        return out

    def _enable_zeropp(self) -> None:
        pp = self.zeropp
        if pp is None:
            return
        for u in self.units:
            if u.world > 1 and pp.applies_to(u.group):
                u.enable_zeropp(quant_block=quantize.weight_block_size(u.shard_numel) if pp.quantized_weights else None,
                                hpz_nodes=pp.nodes if pp.hpz > 1 else None)

    def _offload_params(self, block, aio) -> None:
        device = offload_device(block)
        if device == "cpu":
            for u in self.units:
                u.offload_to_cpu()
        elif device == "nvme":
            from shardwise.zero.offload import NvmeStore

            self.param_store = NvmeStore(block.nvme_path, rank=comm.get_rank(),
                                         threads=aio.thread_count if aio is not None else 1,
                                         block_size=aio.block_size if aio is not None else 1 << 20,
                                         queue_depth=aio.queue_depth if aio is not None else 8)
            for u in self.units:
                u.offload_to_nvme(self.param_store)

    def _before_reduce(self, bucket: Bucket) -> None:
        self.coordinator.order_check.reduce(self.gradients.layout.unit_of_bucket[bucket.position])

    def _unit_reduced(self, bucket: Bucket) -> None:
        """A unit's reduction makes its fragments' gradients final (for the overlapped offload step)."""
        unit = self.gradients.layout.unit_of_bucket[bucket.position]
        self.partition.grads_ready(self.fragments[unit.index])

    # -- what the partitioned step asks (FragmentSource) ---------------------------------------
    def owned_grads(self) -> list[torch.Tensor]:
        return self.gradients.owned_grads()

    def grad_of(self, f: Fragment) -> torch.Tensor:
        return self.gradients.grad_of(f)

    def weight_of(self, f: Fragment) -> torch.Tensor:
        return self.units[f.group].shard[f.local : f.local + f.numel]

    def writable(self, group: int):
        return self.units[group].resident(write=True)  # the shard may live on disk

    @property
    def overlap_safe(self) -> bool:
        """Shards in memory: the overlapped offload step may write them while backward runs (a unit
        whose gradients are final is not gathered again).  Shards on NVMe: not from another thread."""
        return self.param_store is None

    # -- backward -------------------------------------------------------------------------
    @property
    def buckets(self) -> list[Bucket]:
        return self.reducer.buckets

    def prepare_backward(self, *, boundary: bool, no_sync: bool = False) -> None:
        if no_sync:
            raise ValueError("zero_optimization.stage 3 reduces gradients on every backward; "
                             "engine.no_sync() is not supported with it")
        self.gradients.begin()
        self.reducer.begin(active=True)
        if boundary:
            self.partition.arm(self)

    def finish_backward(self) -> None:
        self.reducer.finish()
        self.coordinator.order_check.finish()
        self.partition.backward_finished()
        self.coordinator.end_of_pass()

    # -- step -----------------------------------------------------------------------------
    def local_grad_norm_sq(self, *, counted=None) -> torch.Tensor:
        return self.partition.grad_norm_sq(self, counted=counted)

    def apply_step(self, *, coef: float, coef_fixed: bool = False) -> None:
        self.partition.apply_step(self, coef=coef, coef_fixed=coef_fixed)
        self.coordinator.end_of_pass()  # shards were updated in place; the next forward gathers them

    def zero_grad(self) -> None:
        self.gradients.zero_()

    def refresh_master(self, name: str, p: torch.nn.Parameter) -> None:
        """After ``GatheredParameters(modifier_rank=...)`` rewrote ``p``'s shard: update its fp32 copy."""
        if not self.partition.separate_master:
            return  # the optimizer steps views of the shard itself
        u = zero_unit(p)
        for batch in self.partition.batches():
            with u.resident(write=False):
                for f in batch:
                    if f.name == name and f.group == u.index:
                        f.tensor.data.copy_(u.shard[f.local : f.local + f.numel])

    # -- whole-model views ----------------------------------------------------------------
    def gather_module_state(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A full state dict (parameters gathered one at a time, copied to CPU). Collective."""
        out = {}
        sharded = {id(p) for u in self.units for p in u.params}
        names = {id(p): n for n, p in module.named_parameters()}
        for u in self.units:
            for p in u.params:
                out[names[id(p)]] = gather_full(p).cpu().clone()
        for name, t in module.state_dict(keep_vars=True).items():
            if name not in out and id(t) not in sharded:
                out[name] = t.detach().cpu().clone()
        return out

    def scatter_module_state(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        sharded = {name: p for name, p in module.named_parameters() if is_partitioned(p)}
        with torch.no_grad():
            for name, p in sharded.items():
                if name in state:
                    scatter_full_(p, state[name].to(p.ds_tensor.dtype))
        rest = {k: v for k, v in state.items() if k not in sharded}
        module.load_state_dict(rest, strict=False)
        self.coordinator.end_of_pass()

    # -- introspection --------------------------------------------------------------------
    @property
    def swapper(self):
        return self.partition.swapper

    @property
    def fragments(self) -> list[list[Fragment]]:
        return self.partition.fragments

    @property
    def groups(self) -> list[Unit]:
        return self.units

    def memory_parts(self) -> dict[str, int]:
        return {
            "params": sum(u.shard.nbytes for u in self.units)  # 0 when the shards are on NVMe
            + (self.quantized_store.nbytes() if self.quantized_store is not None else 0),
            "grads": self.gradients.nbytes(),
            "master_params": self.partition.master_bytes(),
            "bucket_buffers": self.reducer.transient_bytes(torch.finfo(self.precision.param_dtype).bits // 8),
            "live_params": sum(u.full_numel * u.shard.element_size() for u in self.units if u.gathered),
            # hpZ: the node-local secondary partition of every unit (allocated on the first gather, kept)
            "hpz_secondary": sum(u.secondary_numel * torch.empty(0, dtype=u.dtype).element_size() for u in self.units),
            # qgZ with zeropp_loco_param: LoCo's error buffers (allocated on a bucket's first reduction, kept)
            "loco_errors": self.zeropp.reducer.loco_bytes() if self.zeropp and self.zeropp.reducer else 0,
            "on_disk": self.partition.disk_bytes() + (self.param_store.disk_bytes() if self.param_store else 0),
        }

    def local_grad(self, name: str, start: int, end: int) -> torch.Tensor:
        return self.gradients.grad_of(self.partition.fragment_at(name, start, end))

    def fragment_batches(self):
        return self.partition.fragment_batches()

    def local_fragments(self):
        return self.partition.local_fragments()


def _group_ranks(group) -> list[int]:
    return list(range(comm.get_world_size())) if group is None else torch.distributed.get_process_group_ranks(group)


def _check_partition_group(name: str, p: torch.nn.Parameter, dp_group) -> None:
    """A parameter ``zero.Init`` partitioned must be cut over the engine's data axis: under tensor, pipeline or
    sequence parallelism that is not the whole world."""
    if p.ds_process_group is dp_group or _group_ranks(p.ds_process_group) == _group_ranks(dp_group):
        return
    raise ValueError(f"parameter '{name}' was partitioned by zero.Init over ranks {_group_ranks(p.ds_process_group)}, "
                     f"but this engine's ZeRO-3 data axis is ranks {_group_ranks(dp_group)}: build the model inside "
                     "zero.Init(mpu=grid) (or data_parallel_group=) with the grid passed to initialize")


def _build_units(module: torch.nn.Module, names: dict[int, str], unit_elements: int):
    """Cut the module tree into units of at most ``unit_elements`` parameters: a module whose whole
    subtree fits (and is sharded over one group) becomes one unit; a bigger one (or a ModuleList/ModuleDict,
    which is never called itself) keeps its direct parameters as a unit and its children are cut the same
    way.  A leaf module (``set_z3_leaf_modules``) is one unit per group its subtree is sharded over (one,
    unless it holds expert parameters), all gathered when it is entered.  Returns the units (index order: last used
    in forward first, the order gradients become ready) and, for each module that needs hooks, the units it
    needs whole: its own units (for a module inside a whole-subtree unit, that unit's: code may call it without
    its root, as DeepSpeed-Chat's reward model calls its backbone from ``forward_value``), plus units of
    parameters it uses but that lie outside its subtree (tied weights, ``register_external_parameter``)."""
    owner: dict[int, list] = {}  # id(param) -> unit params list
    order: list[tuple[torch.nn.Module, list]] = []
    whole: set[int] = set()  # modules whose unit is their whole subtree

    def fresh(params):
        out, seen = [], set()
        for p in params:
            if id(p) not in owner and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def claim(root, params):
        by_group: dict[int, list] = {}  # one unit per partition group, in order of first appearance
        for p in params:
            by_group.setdefault(id(p.ds_process_group), []).append(p)
        for part in by_group.values():
            for p in part:
                owner[id(p)] = part
            order.append((root, part))

    def visit(m: torch.nn.Module) -> None:
        subtree = fresh(p for p in m.parameters())
        container = isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))  # never called itself
        one_group = len({id(p.ds_process_group) for p in subtree}) <= 1
        fits = sum(p.ds_numel for p in subtree) <= unit_elements and not container and one_group
        fits = fits or is_z3_leaf(m)  # set_z3_leaf_modules: the whole subtree is gathered on entry
        if fits or not any(True for _ in m.children()):
            claim(m, subtree)
            whole.add(id(m))
            return
        claim(m, fresh(p for p in m._parameters.values() if p is not None))
        for child in m.children():
            visit(child)

    visit(module)
    units, by_params = [], {}
    roots: dict[int, list[Unit]] = {}
    for index, (root, params) in enumerate(reversed(order)):
        u = Unit(index, params, [names.get(id(p), "?") for p in params])
        units.append(u)
        by_params[id(params)] = u
        roots.setdefault(id(root), []).insert(0, u)  # (forward order: as claimed)
    unit_of = {pid: by_params[id(params)] for pid, params in owner.items()}

    module_units: dict[torch.nn.Module, list[Unit]] = {}

    def assign(m: torch.nn.Module, covered: set[int], enclosing: tuple = ()) -> None:
        own = roots.get(id(m))
        if own is None:  # inside a whole-subtree unit: a module called on its own (not through the unit's
            own = list(enclosing)  # root, e.g. model.backbone from a custom method) gathers the unit too
        elif id(m) in whole:
            enclosing = tuple(own)
        covered = covered | {u.index for u in own}
        used = [p for p in m._parameters.values() if p is not None]
        used += external_params(m)
        extra = []
        for p in used:
            u = unit_of.get(id(p))
            if u is not None and u.index not in covered and u not in extra:
                extra.append(u)
        if own or extra:
            module_units[m] = own + extra
        for child in m.children():
            assign(child, covered, enclosing)

    assign(module, set())
    return units, module_units
