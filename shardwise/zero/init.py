"""``zero.Init``, ``zero.GatheredParameters`` and ``zero.register_external_parameter``.

``Init`` shards every parameter as soon as the module that creates it has
finished its constructor, so a model built inside the context never exists
whole on any rank (at most one module's parameters at a time).
``Module.apply`` is wrapped while the context is active so that
initialisation functions (``model.apply(init_fn)``) see whole parameters.
MoE expert parameters are sharded within their expert-data-parallel group.
"""

from __future__ import annotations

import contextlib
import os

import torch

from shardwise import comm
from shardwise.malloc import return_large_frees_to_the_os
from shardwise.param_attrs import add_external_param
from shardwise.topology import expert_groups
from shardwise.zero import registry
from shardwise.zero.partitioned_param import (ZeroParamStatus, gather_full, is_partitioned, scatter_full_,
                                              shard_param_, unit_of)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declare that ``module``'s forward uses ``parameter`` although another module owns it
    (e.g. a tied LM head reading the embedding weight functionally): stage 3 then gathers it
    around ``module``'s forward and backward too."""
    add_external_param(module, parameter)


class GatheredParameters:
    """Make whole, inside the block, the (stage-3 sharded) ``params``; collective on every rank.

    With ``modifier_rank=r``, changes rank r makes inside the block are broadcast and written back
    into every rank's shard (and the fp32 master weights, when an engine owns the parameter).
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if is_partitioned(p)] if enabled else []
        self.modifier_rank = modifier_rank
        self._saved: list[torch.Tensor] = []

    def __enter__(self):
        self._saved = [(p.data, p.ds_status) for p in self.params]
        for p in self.params:
            p.data = gather_full(p).clone()
            p.ds_status = ZeroParamStatus.AVAILABLE
            p._ds_user_gathered = getattr(p, "_ds_user_gathered", 0) + 1  # (the unit leaves .data alone)
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.modifier_rank is not None and exc[0] is None:
                for p in self.params:
                    group = p.ds_process_group
                    if comm.get_world_size(group) > 1:
                        src = self.modifier_rank if group is None else \
                            torch.distributed.get_global_rank(group, self.modifier_rank)
                        comm.broadcast(p.data, src=src, group=group)
                    scatter_full_(p, p.data)
                    _refresh_owner(p)
        finally:
            for p, (data, status) in zip(self.params, self._saved):
                p._ds_user_gathered -= 1
                unit = unit_of(p)
                if unit is not None and not p._ds_user_gathered:
                    unit.point(p)  # the unit's buffer if gathered, else empty
                    p.ds_status = ZeroParamStatus.AVAILABLE if unit.gathered else ZeroParamStatus.NOT_AVAILABLE
                    continue
                p.data = data
                if p.ds_status is ZeroParamStatus.AVAILABLE:  # (a release inside may have changed it)
                    p.ds_status = status


def _refresh_owner(p: torch.nn.Parameter) -> None:
    unit = unit_of(p)
    if unit is not None and unit.gathered:
        unit.release()  # stale now; the next use gathers the new values
    owner = registry.owner_of(p)
    if owner is not None:
        strategy, name = owner
        strategy.refresh_master(name, p)


def single_rank_group_error(group_size: int, explicit_group, env=None) -> str | None:
    """Why ``zero.Init`` must not go on, or None: the launcher says several processes (``WORLD_SIZE`` > 1) but
    the group the parameters would be sharded over has one rank, and nobody asked for it (no explicit
    ``data_parallel_group``). That happens when a one-rank process group was set up before ``zero.Init``
    (``from_pretrained`` before ``init_distributed()``); every rank would then hold the whole model."""
    if group_size != 1 or explicit_group is not None:
        return None
    env = os.environ if env is None else env
    try:
        launcher_world = int(env.get("WORLD_SIZE", "0") or "0")
    except (TypeError, ValueError):
        return None
    if launcher_world <= 1:
        return None
    return (f"zero.Init resolved a process group of world_size=1, but the launcher environment reports "
            f"WORLD_SIZE={launcher_world}: a one-rank process group was set up before zero.Init (for example "
            "`from_pretrained` ran before `deepspeed.init_distributed()`), so parameters would not be partitioned "
            "and every rank would hold the whole model. Call `init_distributed()` before building the model under "
            "zero.Init, or pass `data_parallel_group` if a one-rank group is meant.")


class Init:
    """Build a model already partitioned for ZeRO stage 3 (DeepSpeed's ``deepspeed.zero.Init``)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **kwargs) -> None:
        self.enabled = enabled
        self.group = data_parallel_group if data_parallel_group is not None else (
            mpu.get_data_parallel_group() if mpu is not None else None)
        self._explicit_group = data_parallel_group
        self.dtype = dtype
        self._patched: list[tuple[type, str, object]] = []
        self._depth: dict[int, int] = {}
        self._meta_depth = 0  # modules being built on the meta device (skip_init), outermost included
        if module is not None and enabled:  # DeepSpeed also accepts an already built module
            comm.init_distributed()
            self._check_group()
            self._shard_tree(module)

    def _check_group(self) -> None:
        problem = single_rank_group_error(comm.get_world_size(self.group), self._explicit_group)
        if problem is not None:
            raise RuntimeError(problem)

    def _shard_tree(self, module: torch.nn.Module) -> None:
        for p in module.parameters():
            if not is_partitioned(p):
                if self.dtype is not None and p.is_floating_point():
                    p.data = p.data.to(self.dtype)
                shard_param_(p, group=self._group_of(p))

    def _group_of(self, p: torch.nn.Parameter):
        """An MoE expert parameter (DeepSpeed's tags: ``allreduce`` False, ``group_name`` ``ep_size_N``) is sharded
        within its expert-data-parallel group, as the engine's ZeRO-3 shards it (the groups are created here,
        over the whole world, when a data group was not given); any other parameter over the data group."""
        name = getattr(p, "group_name", None)
        if self.group is not None or getattr(p, "allreduce", True) or not str(name).startswith("ep_size_"):
            return self.group
        experts = expert_groups(int(str(name)[len("ep_size_"):]))  # the active grid's (else the world's); collective
        if experts.data_size == comm.get_world_size():
            return self.group
        return experts.data_group

    def __enter__(self):
        if not self.enabled:
            return self
        comm.init_distributed()
        self._check_group()
        return_large_frees_to_the_os()  # modules are built and sharded one by one: keep RSS honest
        for cls in _all_module_classes():
            if "__init__" in cls.__dict__:
                original = cls.__dict__["__init__"]
                self._patched.append((cls, "__init__", original))
                setattr(cls, "__init__", self._wrap_init(original))
        self._patched.append((torch.nn.Module, "apply", torch.nn.Module.__dict__["apply"]))
        torch.nn.Module.apply = _gathering_apply()
        return self

    def __exit__(self, *exc) -> None:
        for cls, attr, original in reversed(self._patched):
            setattr(cls, attr, original)
        self._patched.clear()

    def _wrap_init(self, original):
        ctx = self

        def __init__(module, *args, **kwargs):
            key = id(module)
            on_meta = str(kwargs.get("device")) == "meta"  # torch.nn.utils.skip_init builds on meta, then to_empty
            ctx._depth[key] = ctx._depth.get(key, 0) + 1
            ctx._meta_depth += on_meta
            try:
                original(module, *args, **kwargs)
            finally:
                ctx._depth[key] -= 1
                ctx._meta_depth -= on_meta
            if ctx._depth[key] == 0:
                del ctx._depth[key]
                if on_meta and ctx._meta_depth == 0:
                    _shard_after_to_empty(module, ctx)
                elif ctx._meta_depth == 0:  # (inside a meta build, the outermost module shards the tree)
                    ctx._shard_tree(module)

        __init__.__wrapped__ = original
        return __init__


def _shard_after_to_empty(module: torch.nn.Module, ctx: Init) -> None:
    """A module built on the meta device has no values to shard yet; ``skip_init`` gives it (uninitialised)
    storage with ``to_empty`` right after: shard it then (every rank takes rank 0's values, as always)."""
    original = module.to_empty

    def to_empty(*args, **kwargs):
        del module.to_empty  # back to the class's method
        out = original(*args, **kwargs)
        ctx._shard_tree(module)
        return out

    module.to_empty = to_empty


def _all_module_classes() -> list[type]:
    seen, stack = [], [torch.nn.Module]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return seen


def _gathering_apply():
    """``Module.apply`` that shows ``fn`` whole parameters and keeps rank 0's result."""

    def apply(module, fn):
        for m in module.children():
            apply(m, fn)
        own = [p for p in module._parameters.values() if p is not None and is_partitioned(p)]
        with GatheredParameters(own, modifier_rank=0) if own else contextlib.nullcontext():
            fn(module)
        return module

    return apply
