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

import torch

from shardwise import comm
from shardwise.precision import PrecisionPolicy
from shardwise.zero.buckets import Bucket, BucketReducer
from shardwise.zero.coordinator import ParamCoordinator, Unit
from shardwise.zero.partitioned_param import gather_full, is_sharded, scatter_full_, shard_param_
from shardwise.zero.stage12 import PartitionedStrategy, _Fragment, _offload_device
from shardwise.zero.strategy import ReduceSettings


class _UnitBuckets:
    """Presents the trainable parameters of the units as the "group" a ``BucketReducer`` walks."""

    def __init__(self, units: list[Unit], world: int) -> None:
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
                size = u.shard_numel * world
                self.buckets.append((pos, pos + size))
                self.bucket_members.append(members)
                self.unit_of_bucket.append(u)
                pos += size


class Stage3Strategy(PartitionedStrategy):
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
    ) -> None:
        self.stage = 3
        self.optimizer = optimizer
        self.precision = precision
        self.dp_group = dp_group
        self.world = comm.get_world_size(dp_group)
        self.rank = comm.get_rank(dp_group)
        if not any(p.requires_grad for _, p in named_params):
            raise ValueError("the model has no parameter with requires_grad=True: nothing to train")
        names = {id(p): n for n, p in named_params}
        for p in module.parameters():
            if not is_sharded(p):
                shard_param_(p, group=dp_group)
        unit_elements = int(zero_config.stage3_prefetch_bucket_size) if zero_config is not None else 0
        self.units, module_units = _build_units(module, names, self.world, unit_elements)
        threshold = int(zero_config.stage3_param_persistence_threshold) if zero_config is not None else 0
        for u in self.units:
            u.persistent = all(p._sw.numel <= threshold for p in u.params)
        self.groups = self.units  # the fragment/gradient code of stages 1-2 indexes "groups"
        offload = zero_config.offload_optimizer if zero_config is not None else None
        self.offload_device = _offload_device(offload)
        self.param_offload_device = _offload_device(zero_config.offload_param if zero_config is not None else None)
        self._build_partitions()
        self._setup_offload(offload, int(zero_config.sub_group_size) if zero_config is not None else 10**9, aio)
        for u in self.units:  # 16-bit training: shards hold 16-bit weights, masters fp32
            if u.dtype != precision.param_dtype:
                _cast_unit_(u, precision.param_dtype)
        self.param_store = None
        self._offload_params(zero_config.offload_param if zero_config is not None else None, aio)
        self.partition_grads = [torch.zeros(u.shard_numel, dtype=u.dtype, device=u.device) for u in self.units]
        self._layout = _UnitBuckets(self.units, self.world)
        self._bucket_unit = {}
        self.reducer = BucketReducer(
            [self._layout], reduce=reduce, dp_group=dp_group, scatter=True,
            storage=self._bucket_storage, accept=self._accept_grad, done=self._bucket_done,
            max_in_flight=2,
        )
        for b, u in zip(self.reducer.buckets, self._layout.unit_of_bucket):
            self._bucket_unit[b.index] = u
        self._accepted = {u.index: 0 for u in self.units}
        self._trainable = {u.index: sum(p.requires_grad for p in u.params) for u in self.units}
        zc = zero_config
        self.coordinator = ParamCoordinator(
            self.units, module_units, group=dp_group,
            prefetch_elements=int(zc.stage3_prefetch_bucket_size) if zc is not None else 0,
            max_live_elements=int(zc.stage3_max_live_parameters) if zc is not None else 10**9,
            reuse_distance=int(zc.stage3_max_reuse_distance) if zc is not None else 10**9,
        )

    # -- layout ---------------------------------------------------------------------------
    def _wants_master(self) -> bool:
        # Offloaded shards move (to the CPU or a file): the optimizer must not step views of them.
        return super()._wants_master() or (self.offload_device != "nvme" and self.param_offload_device != "none")

    def _build_partitions(self) -> None:
        self.master_buffers = [] if self._wants_master() else None
        self.fragments = []
        replace: dict[int, list[torch.Tensor]] = {}
        for ui, u in enumerate(self.units):
            if self.master_buffers is not None:
                self.master_buffers.append(u.shard.to(device=self._master_device(u.device), dtype=torch.float32,
                                                      copy=True))
            frags = []
            for p, name, off in zip(u.params, u.names, u.offsets):
                start, end = p._sw.owned
                if not p.requires_grad or end <= start:
                    continue
                src = self.master_buffers[ui] if self.master_buffers is not None else u.shard
                t = torch.nn.Parameter(src[off : off + end - start], requires_grad=True)
                frags.append(_Fragment(name, ui, start, end, off, off, t))
                replace.setdefault(id(p), []).append(t)
            self.fragments.append(frags)
        if self.optimizer is not None:
            if self.optimizer.state:
                raise ValueError("the optimizer already has state; pass a freshly constructed optimizer to "
                                 "initialize() (ZeRO replaces its parameters by this rank's partition)")
            for group in self.optimizer.param_groups:
                group["params"] = [t for p in group["params"]
                                   for t in (replace.get(id(p), []) if is_sharded(p) else [p])]

    # -- backward -------------------------------------------------------------------------
    def _bucket_storage(self, b: Bucket) -> torch.Tensor:
        u = self._bucket_unit[b.index]
        return torch.zeros(b.numel, dtype=u.dtype, device=u.device)

    def _accept_grad(self, b: Bucket, i: int, p: torch.Tensor) -> None:
        u = self._bucket_unit[b.index]
        k = u.position_of[id(p)]
        n, off, c = p._sw.numel, u.offsets[k], u.chunks[k]
        rows = b.data.view(self.world, u.shard_numel)[:, off : off + c]  # rank-major: row r -> rank r
        grad = p.grad.reshape(-1)
        full = n // c
        rows[:full].copy_(grad[: full * c].view(full, c))
        if full * c < n:  # the last, partial chunk (the rest of the bucket is already zero)
            rows[full, : n - full * c].copy_(grad[full * c :])
        p.grad = None
        self._accepted[u.index] += 1
        if self._accepted[u.index] == self._trainable[u.index] and not u.persistent and u.users == 0:
            u.release()  # every use of the unit has finished its backward

    def _bucket_done(self, b: Bucket) -> None:
        u = self._bucket_unit[b.index]
        self.partition_grads[u.index].add_(b.data[self.reducer.own_slice(b)])
        b.data = None

    def prepare_backward(self, *, boundary: bool, no_sync: bool = False) -> None:
        if no_sync:
            raise ValueError("zero_optimization.stage 3 reduces gradients on every backward; "
                             "engine.no_sync() is not supported with it")
        self._accepted = dict.fromkeys(self._accepted, 0)
        self.reducer.begin(active=True)

    def finish_backward(self) -> None:
        self.reducer.finish()
        self.coordinator.end_of_pass()

    # -- step -----------------------------------------------------------------------------
    def _offload_params(self, block, aio) -> None:
        device = _offload_device(block)
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

    def _weight_target(self, f) -> torch.Tensor:
        return self.units[f.group].shard[f.local : f.local + f.numel]

    def _write_back(self, frags) -> None:
        by_unit: dict[int, list] = {}
        for f in frags:
            by_unit.setdefault(f.group, []).append(f)
        for ui, fs in by_unit.items():
            with self.units[ui].resident(write=True):  # the shard may live on disk
                super()._write_back(fs)

    def _after_step(self) -> None:
        self.coordinator.end_of_pass()  # shards were updated in place; the next forward gathers them

    def zero_grad(self) -> None:
        for buf in self.partition_grads:
            buf.zero_()
        for u in self.units:
            for p in u.params:
                p.grad = None

    def refresh_master(self, name: str, p: torch.nn.Parameter) -> None:
        """After ``GatheredParameters(modifier_rank=...)`` rewrote ``p``'s shard: update its fp32 copy."""
        if not self._separate_master:
            return  # the optimizer steps views of the shard itself
        u = p._sw.unit
        for batch in self._fragment_batches():
            with u.resident(write=False):
                for f in batch:
                    if f.name == name and f.group == u.index:
                        f.tensor.data.copy_(u.shard[f.local : f.local + f.numel])

    # -- whole-model views ----------------------------------------------------------------
    def module_state_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """A full state dict (parameters gathered one at a time, copied to CPU). Collective."""
        out = {}
        sharded = {id(p) for u in self.units for p in u.params}
        names = {id(p): n for n, p in module.named_parameters()}
        for u in self.units:
            for p in u.params:
                out[names[id(p)]] = gather_full(p, group=self.dp_group).cpu().clone()
        for name, t in module.state_dict(keep_vars=True).items():
            if name not in out and id(t) not in sharded:
                out[name] = t.detach().cpu().clone()
        return out

    def load_module_state_dict(self, module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        sharded = {}
        for name, p in module.named_parameters():
            if is_sharded(p):
                sharded[name] = p
        with torch.no_grad():
            for name, p in sharded.items():
                if name in state:
                    scatter_full_(p, state[name].to(p._sw.shard.dtype))
        rest = {k: v for k, v in state.items() if k not in sharded}
        module.load_state_dict(rest, strict=False)
        self.coordinator.end_of_pass()

    def memory_parts(self) -> dict[str, int]:
        return {
            "params": sum(u.shard.nbytes for u in self.units),  # 0 when the shards are on NVMe
            "grads": sum(t.nbytes for t in self.partition_grads),
            "master_params": sum(t.nbytes for t in self.master_buffers) if self.master_buffers is not None else 0,
            "bucket_buffers": self.reducer.transient_bytes(torch.finfo(self.precision.param_dtype).bits // 8),
            "live_params": sum(u.full_numel * u.shard.element_size() for u in self.units if u.gathered),
            "on_disk": (self.swapper.store.disk_bytes() if self.swapper is not None else 0)
            + (self.param_store.disk_bytes() if self.param_store is not None else 0),
        }


def _cast_unit_(u: Unit, dtype: torch.dtype) -> None:
    """Re-home a (released) unit's shard and gather buffer in ``dtype``."""
    shard = u.shard.to(dtype)
    for p, o, c in zip(u.params, u.offsets, u.chunks):
        p._sw.shard = shard[o : o + c]
    u.shard, u.dtype = shard, dtype
    u.full = torch.empty(u.full_numel, dtype=dtype, device=u.device)
    for p, pos in zip(u.params, u.positions):
        p.data = u.full[pos : pos + p._sw.numel].view(p._sw.shape)
    u._storage_bytes = u.full.untyped_storage().nbytes()
    u.release()


def _build_units(module: torch.nn.Module, names: dict[int, str], world: int, unit_elements: int):
    """Cut the module tree into units of at most ``unit_elements`` parameters: a module whose whole
    subtree fits becomes one unit; a bigger one (or a ModuleList/ModuleDict, which is never called
    itself) keeps its direct parameters as a unit and its children are cut the same way.  Returns the units (index order: last used in forward first, the order
    gradients become ready) and, for each module that needs hooks, the units it needs whole: its own
    unit, plus units of parameters it uses but that lie outside its subtree (tied weights, parameters
    registered with ``register_external_parameter``)."""
    owner: dict[int, list] = {}  # id(param) -> [unit params list, root module]
    order: list[tuple[torch.nn.Module, list]] = []

    def fresh(params):
        out, seen = [], set()
        for p in params:
            if id(p) not in owner and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def claim(root, params):
        if params:
            for p in params:
                owner[id(p)] = params
            order.append((root, params))

    def visit(m: torch.nn.Module) -> None:
        subtree = fresh(p for p in m.parameters())
        container = isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))  # never called itself
        fits = sum(p._sw.numel for p in subtree) <= unit_elements and not container
        if fits or not any(True for _ in m.children()):
            claim(m, subtree)
            return
        claim(m, fresh(p for p in m._parameters.values() if p is not None))
        for child in m.children():
            visit(child)

    visit(module)
    units, by_params = [], {}
    for index, (root, params) in enumerate(reversed(order)):
        u = Unit(index, params, [names.get(id(p), "?") for p in params], world)
        units.append(u)
        by_params[id(params)] = (u, root)
    unit_of = {pid: by_params[id(params)][0] for pid, params in owner.items()}
    roots = {id(root): u for u, root in by_params.values()}

    module_units: dict[torch.nn.Module, list[Unit]] = {}

    def assign(m: torch.nn.Module, covered: set[int]) -> None:
        own = roots.get(id(m))
        covered = covered | ({own.index} if own is not None else set())
        used = [p for p in m._parameters.values() if p is not None]
        used += list(getattr(m, "_sw_external_params", []))
        extra = []
        for p in used:
            u = unit_of.get(id(p))
            if u is not None and u.index not in covered and u not in extra:
                extra.append(u)
        if own is not None or extra:
            module_units[m] = ([own] if own is not None else []) + extra
        for child in m.children():
            assign(child, covered)

    assign(module, set())
    return units, module_units
