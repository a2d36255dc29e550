"""ZeRO stage 3: when parameters are gathered, released and prefetched.

Each module with parameters maps to the units it needs (its own parameters,
tied ones owned elsewhere, and any registered external parameter).  Forward
pre-hook: gather them (waiting for a prefetch if one is in flight) and start
gathering the next units of the recorded forward order; forward post-hook:
release them unless they are persistent or reused soon, and wrap the module's
outputs so that their backward first gathers the units again.

In backward a unit is released once nothing in this backward can still use it:
* every module call that used it with inputs needing a gradient has had its
  backward (its inputs go through ``_ReleaseAfterBackward``, which counts the
  call in ``Unit.backward_uses`` until the gradient of those inputs is computed;
  a call whose graph is dropped unrun stops counting when it is freed; the
  recompute of a non-reentrant checkpoint, whose graph is never run, counts
  nothing), frozen parameters included: a frozen weight is used to compute its
  input's gradient;
* every trainable parameter of the unit, and of the units of the subtrees of the
  modules using it, has its gradient (``grads_complete``): the end of the backward
  of a call whose inputs need no gradient;
* no forward of a module using it is running (a checkpoint's recompute).
A forward that runs inside backward (a checkpoint's recompute) releases its units
by the same rule on exit, not by the forward's, so what the recompute gathered for
parts of the graph that backward never reaches (frozen modules whose inputs need
no gradient) is released at once, and the rest stays for the backward that follows.

Releasing a unit points its parameters' ``.data`` at an empty tensor.  Its
gathered buffer is then either shrunk to zero bytes in place (nobody else holds
it, or autograd may: tensors saved during forward see the same storage once
the unit is gathered again for backward) or handed over to whoever holds it (a
tensor taken from ``param.data`` by the user stays valid; the next gather
allocates a new buffer).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from shardwise import comm
from shardwise.param_attrs import is_z3_leaf, set_zero_unit, zero_unit
from shardwise.zero.gather_order import GatherOrderCheck
from shardwise.zero.partitioned_param import ZeroParamStatus


class Unit:
    """The parameters of one module, gathered and released together over the group they are sharded
    over (one group per unit: the data axis, or an expert-data-parallel group for expert parameters)."""

    def __init__(self, index: int, params: list[torch.nn.Parameter], names: list[str]) -> None:
        self.index = index
        self.params, self.names = params, names
        self.position_of = {id(p): k for k, p in enumerate(params)}
        self.group = params[0].ds_process_group
        self.world = comm.get_world_size(self.group)
        self.dtype = params[0].ds_tensor.dtype
        self.device = params[0].ds_tensor.device
        self.chunks = [p.ds_tensor.numel() for p in params]
        self.numels = [p.ds_numel for p in params]
        self.offsets, off = [], 0
        for c in self.chunks:
            self.offsets.append(off)
            off += c
        self.shard_numel = off
        # Re-home every parameter's shard into one contiguous unit shard.
        self.shard = torch.zeros(off, dtype=self.dtype, device=self.device)
        for p, o, c in zip(params, self.offsets, self.chunks):
            self.shard[o : o + c].copy_(p.ds_tensor)
            p.ds_tensor = self.shard[o : o + c]
            set_zero_unit(p, self)
        self.full_numel = sum(self.numels)
        self.positions, pos = [], 0
        for n in self.numels:
            self.positions.append(pos)
            pos += n
        self.gathered = False
        self._new_full_buffer()
        self.pending = None  # ("comm", work, buffer) in-flight all-gather, or ("disk", future, shard) read
        self.users = 0  # module calls using the unit whose forward is running
        self.backward_uses = 0  # module calls using the unit whose backward is still to run (_Use)
        self.persistent = False
        self.exposed = False  # a forward with autograd used the buffer since the last end of pass
        self.store = None  # NvmeStore when the shard lives in a file (offload_param: nvme)
        self.coordinator = None  # (weakly) the ParamCoordinator that gathers and releases the unit
        # ZeRO++ (zero/zeropp.py): int8 block size of the quantized gather (qwZ), node groups of hpZ's
        # secondary partition and that partition (valid from a gather with autograd on to the end of the pass)
        self.quant_block: int | None = None
        self.hpz = None
        self.secondary: torch.Tensor | None = None
        self.secondary_valid = False
        self.release()

    def enable_zeropp(self, *, quant_block: int | None, hpz_nodes) -> None:
        """Gather as ZeRO++ says: int8 blocks of ``quant_block`` elements (qwZ), and hpZ's secondary
        partition over ``hpz_nodes`` (a ``topology.NodeGroups``)."""
        self.quant_block = quant_block
        self.hpz = hpz_nodes

    @property
    def secondary_numel(self) -> int:
        """Elements of hpZ's secondary shard: the flat unit cut in node-size pieces."""
        return -(-self.full_numel // self.hpz.size) if self.hpz is not None else 0

    def invalidate_secondary(self) -> None:
        self.secondary_valid = False

    def _new_full_buffer(self) -> None:
        """The buffer the whole parameters live in while gathered (allocated by the first gather);
        ``param.data`` are views of it."""
        self.full = None
        self._storage_bytes = self.full_numel * torch.empty(0, dtype=self.dtype).element_size()
        self._empty = torch.empty(0, dtype=self.dtype, device=self.device)
        self._point_params()

    def _point_params(self) -> None:
        """``param.data``: views of the gathered buffer, or an empty tensor while released (not while
        ``GatheredParameters`` holds the parameter: it has its own copy then)."""
        for p in self.params:
            if not user_gathered(p):
                self.point(p)

    def point(self, p: torch.nn.Parameter) -> None:
        k = self.position_of[id(p)]
        pos, n = self.positions[k], self.numels[k]
        p.data = self.full[pos : pos + n].view(p.ds_shape) if self.gathered else self._empty

    def _held_elsewhere(self) -> bool:
        """Whether a tensor other than ``self.full`` and the parameters shares the gathered buffer."""
        others = _storage_holders(self.full) - _storage_holders(torch.empty(0))  # (the second: one tensor)
        return others > (sum(not user_gathered(p) for p in self.params) if self.gathered else 0)

    def keep_holders_valid(self) -> None:
        """Before autograd uses the gathered buffer: if someone else holds it (a tensor taken from
        ``param.data``), leave it to them and continue in a copy."""
        if self.gathered and self.full is not None and self._held_elsewhere():
            self.full = self.full.clone()
            self._point_params()

    def cast_(self, dtype: torch.dtype) -> None:
        """Re-home the (released) shard and gather buffer in ``dtype`` (16-bit training)."""
        self.dtype = dtype
        self.secondary, self.secondary_valid = None, False
        self._point(self.shard.to(dtype))
        self._new_full_buffer()
        self.release()

    def _set_status(self, status: ZeroParamStatus) -> None:
        for p in self.params:
            p.ds_status = status

    # -- where the shard lives (offload_param) ------------------------------------------------
    def _point(self, shard: torch.Tensor) -> None:
        self.shard = shard
        for p, o, c in zip(self.params, self.offsets, self.chunks):
            p.ds_tensor = shard[o : o + c] if shard.numel() else shard

    def offload_to_cpu(self) -> None:
        self._point(self.shard.to("cpu"))

    def offload_to_nvme(self, store) -> None:
        self.store, self.file = store, f"unit{self.index}.bin"
        store.write_async(self.file, self.shard).result()
        self._point(torch.empty(0, dtype=self.dtype))

    @contextlib.contextmanager
    def resident(self, *, write: bool):
        """Hold the shard in memory inside the block (and write it back after, if ``write``)."""
        if self.store is None:
            yield self.shard
            return
        buf = torch.empty(self.shard_numel, dtype=self.dtype)
        self.store.read_async(self.file, buf).result()
        self._point(buf)
        try:
            yield buf
        finally:
            if write:
                self.store.write_async(self.file, buf).result()
            self._point(torch.empty(0, dtype=self.dtype))

    def start_gather(self) -> None:
        if self.gathered or self.pending is not None:
            return
        if self.secondary_valid:  # hpZ: the node's copy of the weights gathered this pass
            self.pending = ("secondary", *self._secondary_gather())
        elif self.store is not None:  # read now; the collective is issued in finish_gather (same order everywhere)
            shard = torch.empty(self.shard_numel, dtype=self.dtype)
            self.pending = ("disk", self.store.read_async(self.file, shard), shard)
        else:
            self.pending = ("comm", *self._all_gather(self.shard, async_op=True))
        self._set_status(ZeroParamStatus.INFLIGHT)

    def _all_gather(self, shard: torch.Tensor, *, async_op: bool):
        shard = shard.to(self.device)  # offload_param cpu: the shard comes to the compute device
        buf = torch.empty(self.shard_numel * self.world, dtype=self.dtype, device=self.device)
        if self.world == 1:
            buf.copy_(shard)
            return None, buf
        if self.quant_block is not None:  # qwZ: int8 blocks on the wire, dequantized on wait()
            from shardwise.zero.zeropp import QuantizedGather

            return QuantizedGather(buf, shard, group=self.group, world=self.world, block=self.quant_block,
                                   async_op=async_op), buf
        return comm.all_gather_into_tensor(buf, shard, group=self.group, async_op=async_op), buf

    def _secondary_gather(self):
        k = self.hpz.size
        buf = torch.empty(self.secondary_numel * k, dtype=self.dtype, device=self.device)
        return comm.all_gather_into_tensor(buf, self.secondary, group=self.hpz.group, async_op=True), buf

    def _keep_secondary(self) -> None:
        """hpZ: keep this rank's piece of the gathered unit for the gathers of the rest of the pass."""
        n = self.secondary_numel
        if self.secondary is None or self.secondary.dtype != self.dtype or self.secondary.device != self.device:
            self.secondary = torch.zeros(n, dtype=self.dtype, device=self.device)
        lo = min(self.hpz.rank * n, self.full_numel)
        hi = min(lo + n, self.full_numel)
        with torch.no_grad():
            self.secondary[: hi - lo].copy_(self.full[lo:hi])
        self.secondary_valid = True

    def finish_gather(self) -> None:
        if self.gathered:
            return
        kind, handle, buf = self.pending
        if kind == "disk":
            handle.result()
            handle, buf = self._all_gather(buf, async_op=False)
        if handle is not None:
            handle.wait()
        self.pending = None
        if self.full is None:  # the last one was handed over on release
            self.full = torch.empty(self.full_numel, dtype=self.dtype, device=self.device)
        else:
            self.full.untyped_storage().resize_(self._storage_bytes)
        self.gathered = True
        self._point_params()
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            if kind == "secondary":
                self.full.copy_(buf[: self.full_numel])
            else:
                rows = buf.view(self.world, self.shard_numel)
                for pos, n, o, c in zip(self.positions, self.numels, self.offsets, self.chunks):
                    self.full[pos : pos + n].copy_(rows[:, o : o + c].reshape(-1)[:n])
        if kind != "secondary" and self.hpz is not None and torch.is_grad_enabled():
            self._keep_secondary()
        self._set_status(ZeroParamStatus.AVAILABLE)

    def release(self) -> None:
        self.gathered = False
        self._point_params()
        if self.full is not None and self._held_elsewhere() and not self.exposed:
            self.full = None  # theirs now; the next gather allocates another
        elif self.full is not None:
            self.full.untyped_storage().resize_(0)
        self._set_status(ZeroParamStatus.NOT_AVAILABLE)


class _GatherBeforeBackward(torch.autograd.Function):
    """Gathers the module's units again when the gradient of its outputs arrives. Each output comes back as
    its own tensor (not a view), which the caller may change in place (``loss *= world``) as it could the
    module's own output. ``touched``: trainable
    parameters of a leaf module, each given a zero gradient here besides whatever its use gives it (autograd
    sums both before accumulating, so the gradient is unchanged). So every parameter of a leaf gets its
    gradient in every backward on every rank, even an expert no token was routed to on this rank: its unit's
    reduction starts at the same point of backward everywhere, not at the end on some ranks only."""

    @staticmethod
    def forward(ctx, coordinator, units, n_outputs, *tensors):
        ctx.coordinator, ctx.units = coordinator, units
        ctx.touched = [(p.ds_shape, p.dtype, p.device) for p in tensors[n_outputs:]]
        return tuple(t.detach() for t in tensors[:n_outputs])

    @staticmethod
    def backward(ctx, *grads):
        ctx.coordinator.fetch_before_backward(ctx.units)
        zeros = [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.touched]
        return (None, None, None, *grads, *zeros)


class _Use:
    """One module call's use of its units that backward has still to finish: counted in their
    ``backward_uses`` until closed, by the backward of the call's inputs or, if that never runs, when the
    graph holding it is freed."""

    __slots__ = ("units", "open")

    def __init__(self, units: list[Unit]) -> None:
        self.units, self.open = units, True
        for u in units:
            u.backward_uses += 1

    def close(self) -> bool:
        if not self.open:
            return False
        self.open = False
        for u in self.units:
            u.backward_uses -= 1
        return True

    def __del__(self) -> None:
        self.close()


class _ReleaseAfterBackward(torch.autograd.Function):
    """Wraps a module call's inputs that need a gradient: its backward runs once autograd computed their
    gradient, that is after every operation of the call that leads to them (DeepSpeed's post-backward
    hook). Outputs are new tensors, not views; gradients pass through unchanged (None stays None)."""

    @staticmethod
    def forward(ctx, coordinator, use, *tensors):
        ctx.coordinator, ctx.use = coordinator, use
        ctx.set_materialize_grads(False)
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        if ctx.use.close():
            ctx.coordinator.release_done(ctx.use.units)
        return (None, None, *grads)


class ParamCoordinator:
    def __init__(self, units: list[Unit], module_units: dict[torch.nn.Module, list[Unit]], *, check_group,
                 prefetch_elements: int, max_live_elements: int, reuse_distance: int) -> None:
        self.units = units
        for u in units:
            u.coordinator = weakref.ref(self)
        self.module_units = module_units
        self.order_check = GatherOrderCheck(units, group=check_group)  # (the first pass: gathers agree)
        self.prefetch_elements = prefetch_elements
        self.max_live_elements = max_live_elements
        self.reuse_distance = reuse_distance
        self.fwd_trace: list[int] = []  # unit order of the previous forward, for prefetching
        self.bwd_trace: list[int] = []
        self._fwd_now: list[int] = []
        self._bwd_now: list[int] = []
        self._handles: dict[torch.nn.Module, tuple] = {}
        self._nested: dict[int, list[bool]] = {}  # id(module) -> per active call: ran inside its units' user?
        self._held = False
        self.unit_grads_complete = lambda unit: True  # (stage3.py: whether its trainable parameters have theirs)
        self._depends: dict[int, list[Unit]] = {}
        self._find_depends()
        for module in module_units:
            self._hook(module)
        # The model's hooks hold the coordinator weakly (a kept model keeps no strategy alive); they go with it.
        self._finalizer = weakref.finalize(self, _remove_handles, self._handles)

    def _find_depends(self) -> None:
        """For each unit, the units whose gradients end the backward of the calls using it: those of the
        using modules' whole subtrees (a parent's frozen parameter may be needed for the gradient of a
        child's trainable one: ``child(x * self.scale)``)."""
        depends: dict[int, dict[int, Unit]] = {}
        for m, units in self.module_units.items():
            below = {u.index: u for c in m.modules() for u in self.module_units.get(c, ())}
            for u in units:
                depends.setdefault(u.index, {}).update(below)
        self._depends = {i: list(d.values()) for i, d in depends.items()}
        self._dependents: dict[int, list[Unit]] = {}
        for i, d in self._depends.items():
            for u in d:
                self._dependents.setdefault(u.index, []).append(self.units[i])

    def grads_arrived(self, unit: Unit) -> None:
        """``unit``'s trainable parameters all have their gradient: release what waited for them."""
        self.release_done(self._dependents.get(unit.index, [unit]))

    def grads_complete(self, unit: Unit) -> bool:
        """Whether every trainable parameter the backward of a call using ``unit`` leads to has its gradient."""
        return all(self.unit_grads_complete(u) for u in self._depends.get(unit.index, (unit,)))

    def _hook(self, module: torch.nn.Module) -> None:
        # (always_call: a forward that raises, or a non-reentrant checkpoint's recompute stopped early once
        # it has what backward needs, still ends its call; the hooks hold the coordinator weakly)
        self._handles[module] = (
            module.register_forward_pre_hook(_weak_call(self._pre_forward), with_kwargs=True),
            module.register_forward_hook(_weak_call(self._post_forward), always_call=True))

    def close(self) -> None:
        """Take every hook off the model and release what is gathered (``engine.destroy()``)."""
        self.release_all()
        self._finalizer()

    def gather_as_one(self, root: torch.nn.Module) -> None:
        """Gather everything ``root``'s subtree needs in ``root``'s hooks, and none inside it (a compiled
        block: hooks inside it would be traced into its graph)."""
        units: list[Unit] = []
        for m in root.modules():
            if m in self.module_units:
                units += [u for u in self.module_units.pop(m) if u not in units]
                for handle in self._handles.pop(m):
                    handle.remove()
        if units:
            self.module_units[root] = units
            self._hook(root)
        self._find_depends()

    # -- gathering ------------------------------------------------------------------------
    def fetch(self, units: list[Unit]) -> None:
        for u in units:
            if not u.gathered and u.pending is None:
                self.order_check.gather(u)
            u.start_gather()
        for u in units:
            u.finish_gather()

    def _live(self) -> int:
        return sum(u.full_numel for u in self.units if u.gathered or u.pending is not None)

    def _prefetch(self, trace: list[int], position: int) -> None:
        if self.order_check.active:
            return
        budget = self.prefetch_elements
        live = self._live()
        for idx in trace[position + 1 :]:
            u = self.units[idx]
            if u.gathered or u.pending is not None:
                continue
            if u.full_numel > budget or live + u.full_numel > self.max_live_elements:
                break
            u.start_gather()
            budget -= u.full_numel
            live += u.full_numel

    @contextlib.contextmanager
    def held(self):
        """Every unit gathered once on entry and kept through the block, the hooks leaving them be (and
        recording no trace): generation runs many forwards over the same weights, without backward.
        The units gathered on entry are released on exit."""
        fresh = [u for u in self.units if not u.gathered]
        self.fetch(self.units)
        self._held = True
        try:
            yield
        finally:
            self._held = False
            for u in fresh:
                if u.gathered and u.users == 0:
                    u.release()

    # -- forward --------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        if self._held:
            return None
        units = self.module_units[module]
        # Called while the modules that gather its units run (a submodule of a whole-subtree unit, inside
        # the unit's root): they are gathered, and the enclosing call's hooks release them and route
        # backward; nothing to gather (and nothing added to the trace prefetching walks).
        nested = all(u.users > 0 for u in units)
        self._nested.setdefault(id(module), []).append(nested)
        if not nested:
            for u in units:
                u.users += 1
            if _in_backward():  # a checkpoint's recompute: part of backward's gathering order
                self.fetch_for_backward(units)
            else:
                self.fetch(units)
                self._fwd_now.extend(u.index for u in units)
                if self.fwd_trace:
                    self._prefetch(self.fwd_trace, len(self._fwd_now) - 1)
            if torch.is_grad_enabled():
                for u in units:
                    if not u.exposed:
                        u.keep_holders_valid()
                        u.exposed = True
        # (nested calls too: backward may reach their inputs after the root's last use; not in the recompute of
        # a non-reentrant checkpoint: its graph is only read for saved tensors, the forward's graph is the one
        # backward runs, and its uses were counted in the forward)
        if torch.is_grad_enabled() and not _in_discarded_recompute():
            return _wrap_inputs(args, kwargs, lambda ts: _ReleaseAfterBackward.apply(self, _Use(units), *ts))
        return None

    def _reused_soon(self, u: Unit) -> bool:
        if not self.fwd_trace:
            return False
        pos = len(self._fwd_now)
        distance = 0
        for idx in self.fwd_trace[pos:]:
            if idx == u.index:
                return True
            distance += self.units[idx].full_numel
            if distance > self.reuse_distance:
                return False
        return False

    def _post_forward(self, module, args, output):
        units = self.module_units[module]
        if not self._held:
            calls = self._nested.get(id(module))
            if not calls or calls.pop():  # (no call: its pre-hook raised before recording it)
                return output
        if torch.is_grad_enabled() and output is not None:
            # (before the release: a leaf's parameters are touched in their full shape)
            touched = [p for u in units for p in u.params if p.requires_grad] if is_z3_leaf(module) else []
            output = _wrap_outputs(output, lambda ts: _GatherBeforeBackward.apply(self, units, len(ts), *ts,
                                                                                   *touched))
        if self._held:  # (generation: the units stay gathered until the block ends)
            return output
        for u in units:
            u.users -= 1
        if _in_backward():  # a recompute: backward follows at once and releases what it uses
            self.release_done(units)
            return output
        for u in units:
            if u.users == 0 and not u.persistent and not self._reused_soon(u):
                u.release()
        return output

    # -- backward -------------------------------------------------------------------------
    def release_done(self, units: list[Unit]) -> None:
        """Release, in backward, each unit nothing can still use (see the module docstring)."""
        for u in units:
            if (u.gathered and not u.persistent and u.users == 0 and u.backward_uses == 0
                    and self.grads_complete(u)):
                u.release()

    def fetch_before_backward(self, units: list[Unit]) -> None:
        """The gradient of a module call's outputs arrived: gather the units its backward can still use. A
        unit none of whose uses is left (all had their backward, or needed none: their inputs need no
        gradient) and none of whose dependent gradients is still to come is not needed: the frozen
        embeddings of a model whose embedding output is made to require grad."""
        needed = [u for u in units if u.persistent or u.backward_uses > 0 or not self.grads_complete(u)]
        if needed:
            self.fetch_for_backward(needed)

    def fetch_for_backward(self, units: list[Unit]) -> None:
        self.fetch(units)
        self._bwd_now.extend(u.index for u in units)
        if self.bwd_trace:
            self._prefetch(self.bwd_trace, len(self._bwd_now) - 1)

    # -- hooks off (generation on weights gathered once: zero/param_offload.py) ------------------
    def hook_handles(self) -> list:
        return [h for m in self.module_units if self._hooked(m) for h in self._handles[m]]

    def _hooked(self, module: torch.nn.Module) -> bool:
        pair = self._handles.get(module)
        return pair is not None and pair[0].id in module._forward_pre_hooks and pair[1].id in module._forward_hooks

    def forget_removed_hooks(self) -> None:
        for m in [m for m in self._handles if not self._hooked(m)]:
            for handle in self._handles.pop(m):
                handle.remove()  # (the other of a pair one of which was removed)

    def restore_hooks(self, root: torch.nn.Module) -> None:
        """Hook every module of ``root``'s subtree that gathers units and lost its hooks."""
        self.forget_removed_hooks()
        for m in root.modules():
            if m in self.module_units and m not in self._handles:
                self._hook(m)

    def forget_trace(self) -> None:
        """Drop the recorded unit order: the next pass prefetches nothing and records a new one."""
        self.fwd_trace, self.bwd_trace = [], []

    def end_of_pass(self) -> None:
        """After backward (or a step): release everything, keep this pass's order for prefetching."""
        if self._fwd_now:
            self.fwd_trace = self._fwd_now
        if self._bwd_now:
            self.bwd_trace = self._bwd_now
        self._fwd_now, self._bwd_now = [], []
        self._nested.clear()  # (a forward that raised leaves its calls open)
        for u in self.units:
            if u.pending is not None:
                u.finish_gather()
            u.users = 0
            if u.gathered:
                u.release()
            u.exposed = False  # (the graph of the pass is gone)
            u.invalidate_secondary()  # (hpZ: the weights may change before the next pass)


    def release_all(self) -> None:
        """Release every gathered unit, persistent ones included (``engine.empty_partition_cache()``);
        the next forward or backward gathers what it needs again."""
        for u in self.units:
            if u.pending is not None:
                u.finish_gather()
            if u.gathered:
                u.release()
            u.invalidate_secondary()


def _weak_call(method):
    """``method`` (bound) as a hook that holds its object weakly; a no-op once the object is gone."""
    ref = weakref.WeakMethod(method)

    def hook(*args):
        bound = ref()
        return bound(*args) if bound is not None else None

    return hook


def _remove_handles(handles: dict) -> None:
    for pair in handles.values():
        for handle in pair:
            handle.remove()
    handles.clear()


def gather_for_gradients(params) -> None:
    """In backward, before gradients are handed to ``params`` directly (``torch.autograd.backward(params,
    grads)``, not through the graph of a module's call): gather the released stage-3 units holding them.
    Autograd checks such a gradient against the parameter's shape and accumulates it in that shape; a
    released parameter is empty. Each unit is released as in any backward: once its trainable parameters
    have their gradients and nothing else in the backward still uses it, or at the end of the pass.
    Parameters outside stage-3 units are left alone."""
    by_coordinator: dict[int, tuple[ParamCoordinator, dict[int, Unit]]] = {}
    for p in params:
        unit = zero_unit(p)
        coordinator = unit.coordinator() if unit is not None and unit.coordinator is not None else None
        if coordinator is not None and not unit.gathered and not user_gathered(p):
            by_coordinator.setdefault(id(coordinator), (coordinator, {}))[1][unit.index] = unit
    for coordinator, units in by_coordinator.values():
        coordinator.fetch_for_backward(list(units.values()))


def user_gathered(p: torch.nn.Parameter) -> bool:
    """Inside ``GatheredParameters`` over ``p`` (its ``.data`` is that block's copy)."""
    return getattr(p, "_ds_user_gathered", 0) > 0


def _storage_holders(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a checkpoint recomputing a forward)."""
    return torch._C._current_graph_task_id() != -1


def _in_discarded_recompute() -> bool:
    """Whether this forward is torch's non-reentrant checkpoint recomputing a region inside backward (the
    saved-tensor hooks on top are its ``_recomputation_hook``'s): the graph it records is never run."""
    if not _in_backward():
        return False
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return hooks is not None and getattr(hooks[0], "__qualname__", "").startswith("_recomputation_hook.")


def _wrap_inputs(args: tuple, kwargs: dict, apply):
    """Route the grad-requiring tensors of a call's arguments (not parameters) through ``apply`` (tuple in,
    tuple out, each tensor once); ``(args, kwargs)`` with them replaced, or None if there are none."""
    tensors, seen = [], set()

    def collect(x):  # (what rebuild can rebuild: tuples, named tuples, lists, plain dicts)
        if isinstance(x, torch.Tensor):
            if x.requires_grad and not isinstance(x, torch.nn.Parameter) and id(x) not in seen:
                seen.add(id(x))
                tensors.append(x)
        elif type(x) in (list, tuple) or (isinstance(x, tuple) and hasattr(x, "_fields")):
            for y in x:
                collect(y)
        elif type(x) is dict:
            for y in x.values():
                collect(y)

    collect(args)
    collect(kwargs)
    if not tensors:
        return None
    wrapped = dict(zip(map(id, tensors), apply(tensors)))

    def rebuild(x):
        if isinstance(x, torch.Tensor):
            return wrapped.get(id(x), x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(rebuild(y) for y in x))
        if type(x) in (list, tuple):
            return type(x)(rebuild(y) for y in x)
        if type(x) is dict:
            return {k: rebuild(v) for k, v in x.items()}
        return x

    return tuple(rebuild(a) for a in args), {k: rebuild(v) for k, v in kwargs.items()}


def _wrap_outputs(output, apply):
    """Route every grad-requiring tensor in ``output`` through ``apply`` (tuple in, tuple out)."""
    tensors = []

    def collect(x):
        if isinstance(x, torch.Tensor):
            if x.requires_grad:
                tensors.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                collect(y)
        elif isinstance(x, dict):
            for y in x.values():
                collect(y)

    collect(output)
    if not tensors:
        return output
    wrapped = dict(zip(map(id, tensors), apply(tensors)))

    def rebuild(x):
        if isinstance(x, torch.Tensor):
            return wrapped.get(id(x), x)
        if isinstance(x, tuple) and hasattr(x, "_fields"):
            return type(x)(*(rebuild(y) for y in x))
        if isinstance(x, (list, tuple)):
            return type(x)(rebuild(y) for y in x)
        if isinstance(x, dict):
            for k in list(x.keys()):
                x[k] = rebuild(x[k])
            return x
        return x

    return rebuild(output)
