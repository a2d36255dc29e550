"""DeepCompile's ZeRO-3 eager fallback bookkeeping (``deepspeed.compile.z3_eager_fallback``).

When a compiled ZeRO-3 forward falls back to eager code, parameters it touches are gathered outside
DeepCompile's own gather/release ops. :class:`DeepCompileZ3EagerFallback` tracks those gathers: which
parameters it owns, which grad-bearing forward graphs still claim them (until their backward
completes), which an explicit user ``GatheredParameters`` context also holds, and it partitions what
is left gathered before the next forward, so Dynamo's guards see the partitioned state they were
built against. The gathers themselves happen in DeepSpeed's ``ZeROOrderedDict`` parameter containers
(deepspeed.runtime.zero.parameter_offload), which hand each parameter they gather to the active fallback,
and ``deepspeed.zero.GatheredParameters`` (deepspeed.runtime.zero.partition_parameters) records its claims
here. Both concern parameters of DeepSpeed's kind (their own ``all_gather`` / ``partition`` methods);
shardwise's ZeRO-3 parameters are gathered and released by their units and never tracked here.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch

from deepspeed.runtime.zero.partition_parameters import (DS_Z3_EAGER_FALLBACK_OWNER_ATTR,
                                                         DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, ZeroParamStatus)
from shardwise.zero.partitioned_param import is_partitioned

_ACTIVE_FALLBACK = None
_GUARDS_MODULE = "torch._dynamo.guards"


def get_active_z3_eager_fallback():
    """The fallback whose forward context is open, or None."""
    return _ACTIVE_FALLBACK


def record_z3_eager_fallback_param(param):
    """Hand a just-gathered parameter to the active fallback; False when none is active."""
    fallback = get_active_z3_eager_fallback()
    if fallback is None:
        return False
    fallback.record_gathered_param(param)
    return True


def is_dynamo_guard_evaluation():
    """Whether the caller runs inside Dynamo's guard code: some frame on the stack belongs to the
    ``torch._dynamo.guards`` module."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_globals.get("__name__") == _GUARDS_MODULE:
            return True
        frame = frame.f_back
    return False


@contextmanager
def deepcompile_z3_forward_context(engine):
    """The engine's fallback forward context when DeepCompile is active under ZeRO-3 (yields the
    fallback), else a no-op context (yields None)."""
    fallback = getattr(engine, "_deepcompile_z3_eager_fallback", None)
    if fallback is None or not engine.is_deepcompile_active() or not engine.zero_optimization_partition_weights():
        yield None
        return
    with fallback.forward_context():
        yield fallback


def _context_depth(param) -> int:
    return getattr(param, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0)


def _gathered_and_releasable(param) -> bool:
    return (getattr(param, "ds_status", None) == ZeroParamStatus.AVAILABLE
            and not getattr(param, "ds_persist", False))


class DeepCompileZ3EagerFallback:
    """Tracks eager-fallback ZeRO-3 gathers of one engine (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self._depth = 0
        self._tracked_params = {}  # ds_id -> param gathered by the fallback
        self._last_gathered_param_ids = []
        self._last_released_param_ids = []
        self._last_guard_suppressed_param_ids = []
        self._last_pre_forward_released_param_ids = []
        self._last_user_adopted_param_ids = []
        self._user_adopted_param_ids = set()
        self._current_forward_param_ids = set()
        self._next_forward_graph_id = 0
        self._outstanding_forward_graph_ids = set()
        self._backward_started_forward_graph_ids = set()
        self._graph_claim_param_ids = {}  # forward graph id -> ds_ids it claims
        self._param_graph_claim_ids = {}  # ds_id -> forward graph ids claiming it
        self._deferred_updated_param_ids = set()
        self._last_completed_forward_graph_ids = []
        self.total_gathered_params = 0

    # ---------------------------------------------------------------- forward context
    @contextmanager
    def forward_context(self):
        """Make this the active fallback; the outermost entry first partitions leftovers from earlier
        forwards and turns the fallback on for the engine's modules (off again on the outermost exit)."""
        global _ACTIVE_FALLBACK
        previous = _ACTIVE_FALLBACK
        self._depth += 1
        if self._depth == 1:
            for ids in (self._last_gathered_param_ids, self._last_guard_suppressed_param_ids,
                        self._last_pre_forward_released_param_ids):
                ids.clear()
            self._current_forward_param_ids.clear()
            self.release_available_params_for_next_forward()
            self._enable_forward_fallback()
        _ACTIVE_FALLBACK = self
        try:
            yield
        finally:
            _ACTIVE_FALLBACK = previous
            self._depth -= 1
            if self._depth == 0:
                self._disable_forward_fallback()

    def _enable_forward_fallback(self):
        from deepspeed.runtime.zero.parameter_offload import ensure_zero_ordered_dict

        for module in self.engine.module.modules():
            ensure_zero_ordered_dict(module)
            module._parameters._in_forward = True

    def _disable_forward_fallback(self):
        for module in self.engine.module.modules():
            if hasattr(module._parameters, "_in_forward"):
                module._parameters._in_forward = False

    # ---------------------------------------------------------------- recording
    def record_gathered_param(self, param):
        """Own ``param`` (taking it from another fallback that owned it) as gathered in this forward."""
        ds_id = param.ds_id
        owner = getattr(param, DS_Z3_EAGER_FALLBACK_OWNER_ATTR, None)
        if owner is not None and owner is not self:
            owner._drop_tracked_param(ds_id, param)
        self._tracked_params[ds_id] = param
        setattr(param, DS_Z3_EAGER_FALLBACK_OWNER_ATTR, self)
        self._current_forward_param_ids.add(ds_id)
        self._last_gathered_param_ids.append(ds_id)
        self.total_gathered_params += 1

    def record_param_access(self, param):
        """A parameter this fallback already holds was used by the current forward."""
        if self._tracked_params.get(param.ds_id) is param:
            self._current_forward_param_ids.add(param.ds_id)

    def _drop_tracked_param(self, ds_id, param):
        if self._tracked_params.get(ds_id) is param:
            del self._tracked_params[ds_id]
        self._current_forward_param_ids.discard(ds_id)
        for graph_id in self._param_graph_claim_ids.pop(ds_id, set()):
            self._graph_claim_param_ids.get(graph_id, set()).discard(ds_id)
        self._deferred_updated_param_ids.discard(ds_id)
        if getattr(param, DS_Z3_EAGER_FALLBACK_OWNER_ATTR, None) is self:
            delattr(param, DS_Z3_EAGER_FALLBACK_OWNER_ATTR)

    def record_user_context_claim(self, param):
        """A user ``GatheredParameters`` context also holds this parameter (reported once per parameter)."""
        if param.ds_id not in self._user_adopted_param_ids:
            self._user_adopted_param_ids.add(param.ds_id)
            self._last_user_adopted_param_ids.append(param.ds_id)

    def release_user_context_claim(self, param):
        """The user context let go: stop tracking ``param`` unless a forward graph or another user
        context still holds it."""
        if not self._param_graph_claim_ids.get(param.ds_id) and not _context_depth(param):
            self._drop_tracked_param(param.ds_id, param)

    def has_outstanding_graph_claim(self, param):
        return bool(self._param_graph_claim_ids.get(param.ds_id))

    def record_deferred_user_update(self, param):
        """The parameter was modified under a user context while a graph held it: partition it as
        updated when it is released."""
        self._deferred_updated_param_ids.add(param.ds_id)

    def record_guard_suppressed_param(self, param):
        """A Dynamo guard read the parameter without gathering it."""
        self._last_guard_suppressed_param_ids.append(param.ds_id)

    def record_forward_graph(self):
        """A grad-bearing forward finished: its parameters stay gathered until its backward completes.
        Returns the new forward graph id."""
        graph_id = self._next_forward_graph_id
        self._next_forward_graph_id += 1
        self._outstanding_forward_graph_ids.add(graph_id)
        claimed = set(self._current_forward_param_ids)
        self._graph_claim_param_ids[graph_id] = claimed
        for ds_id in claimed:
            self._param_graph_claim_ids.setdefault(ds_id, set()).add(graph_id)
        return graph_id

    def record_backward_start(self, graph_id):
        """The backward reached an output of forward graph ``graph_id``."""
        if graph_id in self._outstanding_forward_graph_ids:
            self._backward_started_forward_graph_ids.add(graph_id)

    # ---------------------------------------------------------------- releasing
    @torch.no_grad()
    def release_available_params_for_next_forward(self):
        """Partition tracked parameters nothing holds any more and, when no forward graph is waiting for
        its backward, every other gathered non-persistent engine parameter outside a user context."""
        released = self._release_unclaimed_tracked_params()
        if not self._outstanding_forward_graph_ids and self.engine is not None:
            for param in self.engine.module.parameters():
                if callable(getattr(param, "partition", None)) and not is_partitioned(param) \
                        and _gathered_and_releasable(param) and not _context_depth(param):
                    # (shardwise's ZeRO-3 parameters are released by their units)
                    param.partition()
                    released.append(param.ds_id)
        self._last_pre_forward_released_param_ids = released

    @torch.no_grad()
    def _release_unclaimed_tracked_params(self):
        released = []
        for ds_id, param in list(self._tracked_params.items()):
            if self._param_graph_claim_ids.get(ds_id) or _context_depth(param):
                continue
            if _gathered_and_releasable(param):
                if ds_id in self._deferred_updated_param_ids:
                    param.partition(has_been_updated=True)
                else:
                    param.partition()
                released.append(ds_id)
            self._drop_tracked_param(ds_id, param)
        return released

    @torch.no_grad()
    def _release_gathered_params(self):
        self._last_released_param_ids = self._release_unclaimed_tracked_params()

    def complete_backward(self):
        """After a backward: the forward graphs it reached give up their claims, and parameters no
        longer claimed are partitioned."""
        completed = sorted(self._backward_started_forward_graph_ids)
        if not completed:
            return
        self._backward_started_forward_graph_ids.clear()
        self._outstanding_forward_graph_ids.difference_update(completed)
        for graph_id in completed:
            for ds_id in self._graph_claim_param_ids.pop(graph_id, set()):
                claims = self._param_graph_claim_ids.get(ds_id)
                if claims is None:
                    continue
                claims.discard(graph_id)
                if not claims:
                    del self._param_graph_claim_ids[ds_id]
        self._last_completed_forward_graph_ids = completed
        self._release_gathered_params()

    def release_gathered_params(self):
        """Abandon all pending backward work and partition what the fallback holds."""
        self._outstanding_forward_graph_ids.clear()
        self._backward_started_forward_graph_ids.clear()
        self._graph_claim_param_ids.clear()
        self._param_graph_claim_ids.clear()
        self._release_gathered_params()

    def stats(self):
        """The fallback's state and its last actions, for diagnostics and tests."""
        return {
            "tracked_param_ids": sorted(self._tracked_params),
            "last_gathered_param_ids": list(self._last_gathered_param_ids),
            "last_released_param_ids": list(self._last_released_param_ids),
            "last_guard_suppressed_param_ids": list(self._last_guard_suppressed_param_ids),
            "last_pre_forward_released_param_ids": list(self._last_pre_forward_released_param_ids),
            "last_user_adopted_param_ids": list(self._last_user_adopted_param_ids),
            "current_forward_param_ids": sorted(self._current_forward_param_ids),
            "outstanding_forward_graph_ids": sorted(self._outstanding_forward_graph_ids),
            "backward_started_forward_graph_ids": sorted(self._backward_started_forward_graph_ids),
            "graph_claim_param_ids": {g: sorted(ids) for g, ids in sorted(self._graph_claim_param_ids.items())},
            "param_graph_claim_ids": {d: sorted(gs) for d, gs in sorted(self._param_graph_claim_ids.items())},
            "context_claimed_param_ids": sorted(d for d, p in self._tracked_params.items() if _context_depth(p)),
            "deferred_updated_param_ids": sorted(self._deferred_updated_param_ids),
            "last_completed_forward_graph_ids": list(self._last_completed_forward_graph_ids),
            "total_gathered_params": self.total_gathered_params,
        }
