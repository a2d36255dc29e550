"""The flops profiler: per-module parameters, FLOPs/MACs and latency of the model as it runs.

FLOPs come from torch's own formulas (``torch.utils.flop_counter``: matmuls, convolutions,
attention kernels) applied by a dispatch mode to every op that runs while the profiler is on.
Forward-hooks on each submodule keep a stack of the modules being run, so an op's FLOPs are
added to the module that ran it and to all its ancestors. Ops that run inside autograd's
backward are counted as backward (recomputation under activation checkpointing included).
Element-wise ops (activations, norms, softmax) have no formula in torch and count as zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from .params import count_parameters
from .report import format_profile, human

__all__ = ["FlopsProfiler", "ModuleStats"]


def _cpu_sdpa(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


def _cpu_sdpa_backward(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# torch has formulas for the CUDA attention kernels but not for the CPU flash kernel.
_EXTRA_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}


def _formula(packet):
    return flop_registry.get(packet) or _EXTRA_FORMULAS.get(packet)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _param_count(module: torch.nn.Module) -> int:
    return count_parameters(module, trainable_only=False)  # full sizes, also under ZeRO-3


@dataclass
class ModuleStats:
    name: str  # qualified name inside the profiled model ("" for the model itself)
    type: str
    depth: int  # 0 for the model, 1 for its children, ...
    params: int
    flops: int = 0  # forward FLOPs, summed over calls
    calls: int = 0
    latency: float = 0.0  # forward seconds, summed over calls
    children: list[str] = field(default_factory=list)

    @property
    def macs(self) -> int:
        return self.flops // 2


class _Counter(TorchDispatchMode):
    def __init__(self, profiler: "FlopsProfiler | None") -> None:
        super().__init__()
        self.profiler = profiler

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = _formula(func._overloadpacket)
        if formula is not None and self.profiler is not None:
            self.profiler._add(int(formula(*args, **kwargs, out_val=out)))
        return out


class FlopsProfiler:
    """Profile ``model``: ``start_profile()``, run steps, ``stop_profile()``, read or print, ``end_profile()``.

    DeepSpeed's method names; the engine drives it from the ``flops_profiler`` config block.
    """

    def __init__(self, model: torch.nn.Module, *, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self._mode: _Counter | None = None
        self._handles: list = []
        self._stack: list[ModuleStats] = []
        self._t0: list[float] = []
        self.reset()

    # -- control ---------------------------------------------------------------------------
    def reset(self) -> None:
        self.stats: dict[str, ModuleStats] = {}
        for name, mod in self.model.named_modules():
            depth = 0 if name == "" else name.count(".") + 1
            self.stats[name] = ModuleStats(name, type(mod).__name__, depth, _param_count(mod))
        for name in self.stats:
            if name:
                parent = name.rsplit(".", 1)[0] if "." in name else ""
                self.stats[parent].children.append(name)
        self.forward_flops = 0
        self.backward_flops = 0  # includes recomputation in backward
        self.recompute_flops = 0  # the part of backward_flops that re-ran module forwards
        self.other_flops = 0  # outside module forwards and backward (loss, optimizer, ...)
        self.wall_time = 0.0
        self._wall_start: float | None = None

    @property
    def started(self) -> bool:
        return self._mode is not None

    def start_profile(self, ignore_list=None) -> None:
        """Count from now on. ``ignore_list``: module types whose submodules are not reported separately."""
        if self.started:
            return
        self.reset()
        ignore = tuple(ignore_list or ())
        for name, mod in self.model.named_modules():
            if ignore and any(isinstance(a, ignore) for a in self._ancestors(name)):
                continue
            self._handles.append(mod.register_forward_pre_hook(self._pre_hook(name)))
            self._handles.append(mod.register_forward_hook(self._post_hook(name), always_call=True))
        _warm_up_dispatch()
        self._mode = _Counter(self)
        self._mode.__enter__()
        self._wall_start = time.perf_counter()

    def stop_profile(self) -> None:
        """Stop counting (results stay readable until ``end_profile``)."""
        if not self.started:
            return
        self._mode.__exit__(None, None, None)
        self._mode = None
        self.wall_time += time.perf_counter() - (self._wall_start or time.perf_counter())
        for h in self._handles:
            h.remove()
        self._handles = []
        self._stack, self._t0 = [], []
        self._roll_up()

    def _roll_up(self) -> None:
        """Containers that are never called themselves (ModuleList, ModuleDict) get their children's sums."""
        for s in sorted(self.stats.values(), key=lambda s: -s.depth):
            if s.calls == 0 and s.children:
                kids = [self.stats[c] for c in s.children]
                s.flops = sum(k.flops for k in kids)
                s.latency = sum(k.latency for k in kids)

    def end_profile(self) -> None:
        self.stop_profile()
        self.reset()

    # -- results ---------------------------------------------------------------------------
    def get_total_flops(self, as_string: bool = False):
        return human(self.forward_flops, "FLOPs") if as_string else self.forward_flops

    def get_total_macs(self, as_string: bool = False):
        return human(self.forward_flops // 2, "MACs") if as_string else self.forward_flops // 2

    def get_total_params(self, as_string: bool = False):
        n = self.stats[""].params
        return human(n, "") if as_string else n

    def get_total_duration(self, as_string: bool = False):
        t = self.stats[""].latency
        return f"{t * 1000:.2f} ms" if as_string else t

    def module_stats(self) -> list[ModuleStats]:
        """Every module's stats, in registration order (the model first)."""
        return list(self.stats.values())

    def top_modules(self, depth: int, k: int, key: str = "flops") -> list[ModuleStats]:
        """The ``k`` modules at ``depth`` with the largest ``key`` ("flops", "params" or "latency")."""
        at = [s for s in self.stats.values() if s.depth == depth]
        return sorted(at, key=lambda s: getattr(s, key), reverse=True)[:k]

    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> str:
        """Format the profile; print it, or write it to ``output_file``. Returns the text."""
        text = format_profile(self, profile_step=profile_step, module_depth=module_depth,
                              top_modules=top_modules, detailed=detailed)
        if output_file:
            with open(output_file, "w") as f:
                f.write(text + "\n")
        else:
            print(text, flush=True)
        return text

    # -- internals -------------------------------------------------------------------------
    def _ancestors(self, name: str):
        parts = name.split(".") if name else []
        mods = dict(self.model.named_modules())
        return [mods[".".join(parts[:i])] for i in range(len(parts))]

    def _pre_hook(self, name: str):
        def hook(module, args):
            _sync(module)
            self._stack.append(self.stats[name])
            self._t0.append(None if _in_backward() else time.perf_counter())  # recompute: not timed
        return hook

    def _post_hook(self, name: str):
        def hook(module, args, output):
            if not self._stack or self._stack[-1].name != name:
                return  # a forward that raised before our pre-hook ran
            stats, t0 = self._stack.pop(), self._t0.pop()
            if t0 is not None:
                _sync(module)
                stats.latency += time.perf_counter() - t0
                stats.calls += 1
        return hook

    def _add(self, flops: int) -> None:
        if _in_backward():
            self.backward_flops += flops
            if self._stack:
                self.recompute_flops += flops
            return
        if not self._stack:
            self.other_flops += flops
            return
        self.forward_flops += flops
        for s in {id(s): s for s in self._stack}.values():  # a module re-entered counts once
            s.flops += flops


_dispatch_warm = False


def _warm_up_dispatch() -> None:
    """The first op under any Python dispatch mode costs about a second; pay it before timing."""
    global _dispatch_warm
    if not _dispatch_warm:
        with _Counter(None):
            torch.zeros(1) + 1
        _dispatch_warm = True


def _sync(module: torch.nn.Module) -> None:
    p = next(module.parameters(), None)
    if p is not None and p.device.type not in ("cpu", "meta"):
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            acc.synchronize()

