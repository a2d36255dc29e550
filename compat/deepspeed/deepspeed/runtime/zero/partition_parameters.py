"""``deepspeed.runtime.zero.partition_parameters``: shardwise's ``zero.Init`` with DeepSpeed's memory-efficient
linear, ``GatheredParameters`` extended to DeepSpeed's self-gathering parameters, and DeepSpeed's helper names
of this module."""

from shardwise.zero.init import GatheredParameters as _ShardwiseGatheredParameters
from shardwise.zero.init import Init as _ShardwiseInit
from shardwise.zero.init import register_external_parameter
from shardwise.zero.partitioned_param import ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "InsertPostInitMethodToModuleSubClasses", "ZeroParamStatus",
           "register_external_parameter", "zero3_linear_wrap"]

import functools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from shardwise.accelerator import get_accelerator  # noqa: E402,F401  (DeepSpeed's module exposes it)

from .linear import zero3_linear_wrap  # noqa: E402


class InsertPostInitMethodToModuleSubClasses:
    """DeepSpeed's base class of ``zero.Init``. Once a ``zero.Init`` with ``mem_efficient_linear`` has run, the
    class attribute ``linear_bk`` holds the ``torch.nn.functional.linear`` found then (torch's own, unless
    something had replaced it first): the function to put back to undo the swap (DeepSpeed leaves the swap
    in place for the rest of the process)."""


def _use_mem_efficient_linear() -> None:
    """``torch.nn.functional.linear`` becomes ``zero3_linear_wrap`` (which saves the weight parameter itself
    for backward, so a ZeRO-3 weight released after forward holds no memory until backward), for the rest of
    the process. The function found the first time is kept as ``InsertPostInitMethodToModuleSubClasses.linear_bk``;
    later calls swap again only when ``F.linear`` is that function again (someone put it back), and leave
    any other replacement (a wrapper around ``zero3_linear_wrap``) alone."""
    holder = InsertPostInitMethodToModuleSubClasses
    if not hasattr(holder, "linear_bk"):
        holder.linear_bk = torch.nn.functional.linear
    if torch.nn.functional.linear is holder.linear_bk:
        torch.nn.functional.linear = zero3_linear_wrap


def _config_dict(config) -> dict:
    """A DeepSpeed config given as a dict or a JSON/hjson file path, as a dict."""
    if isinstance(config, (str, os.PathLike)):
        from shardwise.config.loader import read_config_file

        config = read_config_file(Path(config))
    if not isinstance(config, dict):
        raise TypeError(f"zero.Init: config_dict_or_path must be a dict or a path to a JSON file, not "
                        f"{type(config).__name__}")
    return config


def _block(config: dict, key: str) -> dict:
    block = config.get(key) or {}
    if not isinstance(block, dict):
        raise ValueError(f"zero.Init: {key} must be a dict, not {type(block).__name__}")
    return block


def _quantize_functionals() -> None:
    """``F.linear`` and ``F.embedding`` dequantize quantized weights (``wrap_quantized_functional``) and
    ``nn.Linear`` / ``nn.Embedding`` quantize a whole weight loaded from a state dict, for the rest of the
    process; each is wrapped once."""
    from deepspeed.inference.quantization.utils import (WEIGHT_QUANTIZATION_LAYERS, wrap_load_from_state_dict,
                                                        wrap_quantized_functional)

    for name in ("linear", "embedding"):
        fn = getattr(torch.nn.functional, name)
        if not getattr(fn, "_dequantizes", False):
            setattr(torch.nn.functional, name, wrap_quantized_functional(fn))
    for cls in WEIGHT_QUANTIZATION_LAYERS:
        if not getattr(cls._load_from_state_dict, "_quantizes_state", False):
            cls._load_from_state_dict = wrap_load_from_state_dict(cls._load_from_state_dict)


class _Gathered:
    """What ``param.all_gather_coalesced`` returns: the parameters are whole already; ``wait`` returns at once
    (DeepSpeed's handle waits for its collective)."""

    def __init__(self, params) -> None:
        self.params = params

    def wait(self, handle_dependency: bool = True) -> None:
        pass


def _user_gather(params) -> None:
    """Make the released shardwise ZeRO-3 parameters among ``params`` whole until ``_user_release`` (collective
    over their groups), as ``GatheredParameters`` does, each under its own context kept on the parameter."""
    from shardwise.zero.partitioned_param import is_partitioned

    for p in params:
        if is_partitioned(p) and p.ds_status is ZeroParamStatus.NOT_AVAILABLE \
                and getattr(p, "_ds_method_gather", None) is None:
            ctx = _ShardwiseGatheredParameters([p])
            ctx.__enter__()
            p._ds_method_gather = ctx


def _user_release(params, has_been_updated: bool) -> None:
    """Undo ``_user_gather`` for ``params``: with ``has_been_updated`` the whole values (this rank's) are written
    back into the shard (and an engine's fp32 master weights) first. Parameters gathered by the ZeRO-3
    coordinator for a running forward or backward, rather than by ``all_gather``, are its to release."""
    from shardwise.zero.init import _refresh_owner
    from shardwise.zero.partitioned_param import scatter_full_

    for p in params:
        ctx = getattr(p, "_ds_method_gather", None)
        if ctx is None:
            continue
        p._ds_method_gather = None
        try:
            if has_been_updated:
                scatter_full_(p, p.data)
                _refresh_owner(p)
        finally:
            ctx.__exit__(None, None, None)


def _add_param_methods(p) -> None:
    """Give a shardwise ZeRO-3 parameter the methods DeepSpeed's ``zero.Init`` gives its parameters:
    ``all_gather(param_list=None)`` and ``all_gather_coalesced(params)`` make the parameters whole (``ds_status``
    AVAILABLE), ``partition(param_list=None, has_been_updated=False)`` releases what they gathered (writing the
    whole values back into the shard when ``has_been_updated``), and the sizes of the partition layout:
    ``partition_numel()`` (elements per rank), ``aligned_size()`` (that times the group size) and
    ``padding_size()`` (the zero padding at the end of the last rank's partition)."""
    from shardwise.zero.partitioned_param import chunk_size

    def all_gather(param_list=None, async_op=False, hierarchy=0):
        _user_gather([p] if param_list is None else list(param_list))
        return _Gathered([p] if param_list is None else list(param_list))

    def all_gather_coalesced(params, safe_mode=False, quantize=False):
        params = list(params)
        _user_gather(params)
        return _Gathered(params)

    def partition(param_list=None, has_been_updated=False, free_data=True):
        _user_release([p] if param_list is None else list(param_list), has_been_updated)

    def partition_numel():
        return chunk_size(p)

    def aligned_size():
        from shardwise import comm

        return chunk_size(p) * comm.get_world_size(p.ds_process_group)

    def padding_size():
        return aligned_size() - p.ds_numel

    for fn in (all_gather, all_gather_coalesced, partition, partition_numel, aligned_size, padding_size):
        setattr(p, fn.__name__, fn)


def _add_methods_to_tree(module) -> None:
    from shardwise.zero.partitioned_param import is_partitioned

    for p in module.parameters():
        if is_partitioned(p) and not hasattr(p, "all_gather_coalesced"):
            _add_param_methods(p)


class Init(_ShardwiseInit, InsertPostInitMethodToModuleSubClasses):
    """``deepspeed.zero.Init``: shardwise's ``zero.Init`` (parameters sharded as each module is built, or
    ``module`` sharded at once) with DeepSpeed's ``mem_efficient_linear``: when true (the default), entering the
    context, or building one around an existing ``module``, installs ``zero3_linear_wrap`` as
    ``torch.nn.functional.linear`` for the rest of the process (see ``_use_mem_efficient_linear``). A config
    (``config_dict_or_path``, or the older ``config``) decides it instead of the argument:
    ``zero_optimization.memory_efficient_linear``, true unless set.

    With a config block ``weight_quantization.quantized_initialization`` (``num_bits`` 4 or 8, ``group_size``,
    ``group_dim``, ``symmetric`` false; the memory-efficient linear must be on, else ``ValueError``), entering
    the context also makes ``F.linear`` / ``F.embedding`` dequantize quantized weights, and the weight of every
    ``nn.Linear`` / ``nn.Embedding`` built inside is quantized before it is partitioned
    (``deepspeed.inference.quantization.utils``): ZeRO-Inference's quantized weights. shardwise's engine config refuses the ``weight_quantization`` block:
    a model built this way runs under an engine whose config leaves it out. The quantized weights are stored
    in ``dtype``, else the config's training dtype (``bf16`` / ``fp16`` enabled), so the engine's cast to that
    dtype leaves their bytes alone.

    Every partitioned parameter gets DeepSpeed's per-parameter methods (``_add_param_methods``)."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 **kwargs) -> None:
        if config_dict_or_path is None:
            config_dict_or_path = config
        self.quantized_initialization = None
        self._building = False
        if config_dict_or_path is not None:
            ds_config = _config_dict(config_dict_or_path)
            mem_efficient_linear = _block(ds_config, "zero_optimization").get("memory_efficient_linear", True)
            if not isinstance(mem_efficient_linear, bool):
                raise ValueError("zero.Init: zero_optimization.memory_efficient_linear must be true or false, not "
                                 f"{mem_efficient_linear!r}")
            quantized = _block(ds_config, "weight_quantization").get("quantized_initialization")
            if quantized:
                from deepspeed.inference.quantization.utils import _check_config

                self.quantized_initialization = _check_config(quantized)
                if dtype is None:  # stored in the training dtype: the engine must not cast the codes' bytes
                    dtype = (torch.bfloat16 if _block(ds_config, "bf16").get("enabled")
                             or _block(ds_config, "bfloat16").get("enabled") else
                             torch.float16 if _block(ds_config, "fp16").get("enabled") else None)
        self.mem_efficient_linear = bool(mem_efficient_linear)
        if self.quantized_initialization and not self.mem_efficient_linear:
            raise ValueError("zero.Init: weight_quantization.quantized_initialization needs the memory-efficient linear "
                             "(zero_optimization.memory_efficient_linear true, the default): the F.linear that "
                             "dequantizes the weights is installed with it")
        super().__init__(module=module, data_parallel_group=data_parallel_group,
                         mem_efficient_linear=mem_efficient_linear, remote_device=remote_device,
                         pin_memory=pin_memory, config_dict_or_path=config_dict_or_path, enabled=enabled,
                         dtype=dtype, mpu=mpu, **kwargs)
        if module is not None and enabled and self.mem_efficient_linear:
            _use_mem_efficient_linear()

    def __enter__(self):
        out = super().__enter__()
        if self.enabled and self.mem_efficient_linear:
            _use_mem_efficient_linear()
            if self.quantized_initialization:
                _quantize_functionals()
                self._building = True
        return out

    def __exit__(self, *exc) -> None:
        self._building = False
        return super().__exit__(*exc)

    def _shard_tree(self, module) -> None:
        if self._building:  # a module built inside: its Linear / Embedding weights are stored quantized
            self._quantize_tree(module)
        super()._shard_tree(module)
        _add_methods_to_tree(module)  # DeepSpeed's per-parameter methods (_add_param_methods)

    def _quantize_tree(self, module) -> None:
        from deepspeed.inference.quantization.utils import WEIGHT_QUANTIZATION_LAYERS, _quantize_param
        from shardwise.zero.partitioned_param import is_partitioned

        for m in module.modules():
            weight = m._parameters.get("weight") if type(m) in WEIGHT_QUANTIZATION_LAYERS else None
            if weight is None or is_partitioned(weight) or getattr(weight, "weight_quantized", False):
                continue
            if self.dtype is not None and weight.is_floating_point():
                weight.data = weight.data.to(self.dtype)
            _quantize_param(weight, self.quantized_initialization)

# DeepSpeed's zero.Init swaps torch's tensor constructors for versions that build floating tensors in
# the training dtype on the device; Hugging Face's `prevent_arange_dtype_change` replaces the wrapper
# below around `zero.Init` and compares against `_orig_torch_arange`. shardwise's Init does not swap
# constructors (parameters are sharded as each module finishes its __init__ and cast by the engine),
# so these names exist for that code to find and restore (DeepSpeed's module keeps one per constructor it
# swaps: tests rebind `_orig_torch_empty` around an Init); the wrapper keeps DeepSpeed's meaning.
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange
_orig_torch_eye = torch.eye
_orig_torch_randn = torch.randn


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype: torch.dtype, target_device=None):
    """``fn`` (a tensor constructor) whose floating results are cast to ``target_fp_dtype`` and built on
    ``target_device`` when no device is given (DeepSpeed's helper of the same name)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if kwargs.get("device") is None and target_device is not None:
            kwargs["device"] = target_device
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped


__all__ += ["zero_wrapper_for_fp_tensor_constructor"]


class MultipleAllGatherHandles:
    """Several all-gather handles waited on as one (DeepSpeed's class of that name): ``wait`` passes its
    keyword on to every handle's ``wait``."""

    def __init__(self, handles) -> None:
        self.handles = handles

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


__all__ += ["MultipleAllGatherHandles"]

# The shape of a ZeRO-3 parameter's ``.data`` while it is partitioned (released): empty, in shardwise
# (shardwise.zero.partitioned_param) as in DeepSpeed.
partitioned_param_data_shape = [0]
__all__ += ["partitioned_param_data_shape"]


def _contradicting_single_rank_pg_error(dp_world_size, explicit_process_group, env=None):
    """DeepSpeed's check that ``zero.Init``'s group does not contradict the launcher's ``WORLD_SIZE`` (its message,
    or None); ``shardwise.zero.init.single_rank_group_error``, which ``zero.Init`` raises as ``RuntimeError``."""
    from shardwise.zero.init import single_rank_group_error

    return single_rank_group_error(dp_world_size, explicit_process_group, env)


# Attributes DeepSpeed puts on a ZeRO-3 parameter: the DeepCompile eager fallback that holds it gathered
# (deepspeed.compile.z3_eager_fallback), and how many user GatheredParameters contexts hold it.
DS_Z3_EAGER_FALLBACK_OWNER_ATTR = "_ds_z3_eager_fallback_owner"
DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR = "_ds_z3_gathered_param_context_depth"
__all__ += ["DS_Z3_EAGER_FALLBACK_OWNER_ATTR", "DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR", "print_rank_0"]


def print_rank_0(message, debug=False, force=False) -> None:
    """Print ``message`` on global rank 0 when ``debug`` or ``force`` asks for it (DeepSpeed's helper)."""
    from shardwise import comm

    if (debug or force) and comm.get_rank() == 0:
        print(message)


def _gathers_itself(param) -> bool:
    """A ZeRO-3 parameter of DeepSpeed's kind: it carries ``ds_id`` and its own ``all_gather`` / ``partition``
    methods (DeepSpeed's ``zero.Init`` attaches them; shardwise's partitioned parameters have neither and are
    gathered through their shard instead)."""
    from shardwise.zero.partitioned_param import is_partitioned

    return (isinstance(param, torch.Tensor) and hasattr(param, "ds_id") and not is_partitioned(param)
            and callable(getattr(param, "all_gather", None)) and callable(getattr(param, "partition", None)))


def _context_depth(param) -> int:
    return getattr(param, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, 0)


class GatheredParameters(_ShardwiseGatheredParameters):
    """``deepspeed.zero.GatheredParameters`` (shardwise.zero.GatheredParameters) for parameters of either kind.

    shardwise's partitioned parameters are gathered and written back exactly as shardwise's context does.
    Parameters that gather and partition themselves, as DeepSpeed's ZeRO-3 parameters do (``all_gather``
    and ``partition`` methods), follow DeepSpeed's protocol: one ``all_gather(param_list=...)`` on entry over
    the parameters ordered by ``ds_id`` and without duplicates, one ``partition(param_list=...,
    has_been_updated=...)`` on exit (after broadcasting ``modifier_rank``'s values when one is given), and a
    per-parameter nesting depth (``_ds_z3_gathered_param_context_depth``). Nested contexts may hold disjoint
    parameters only: entering one that shares parameters with an enclosing context raises ``RuntimeError``
    before anything is gathered. A parameter that a DeepCompile eager-fallback forward also holds
    (``deepspeed.compile.z3_eager_fallback``) is claimed by the context while it is open and stays gathered
    on exit while a forward graph still waits for its backward; the fallback partitions it then."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True) -> None:
        if isinstance(params, torch.Tensor):
            listed = [params]
        else:
            try:
                listed = list(params)  # a generator (module.parameters()) is read twice
            except TypeError:  # neither a tensor nor an iterable of them: nothing to gather, as DeepSpeed
                listed = [params]
        super().__init__(listed, modifier_rank=modifier_rank, fwd_module=fwd_module, enabled=enabled)
        own = {}
        for p in listed if enabled else ():
            if _gathers_itself(p):
                own.setdefault(id(p), p)
        self._ds_params = sorted(own.values(), key=lambda p: p.ds_id)
        self._ds_modifier_rank = modifier_rank
        self._fallback_owners = {}
        if fwd_module is not None:
            for p in self._ds_params:
                register_external_parameter(fwd_module, p)

    def __enter__(self):
        overlapping = [p.ds_id for p in self._ds_params if _context_depth(p) > 0]
        if overlapping:
            raise RuntimeError("Nested GatheredParameters contexts cannot overlap parameters; parameter ds_ids "
                               f"already gathered by an enclosing context: {overlapping}")
        super().__enter__()
        if not self._ds_params:
            return self
        try:
            self._ds_params[0].all_gather(param_list=self._ds_params)
        except BaseException:
            super().__exit__(*sys.exc_info())
            raise
        for p in self._ds_params:
            setattr(p, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, _context_depth(p) + 1)
            owner = getattr(p, DS_Z3_EAGER_FALLBACK_OWNER_ATTR, None)
            if owner is not None:
                self._fallback_owners[p.ds_id] = owner
                owner.record_user_context_claim(p)
        return self

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._ds_params:
                self._exit_own()

    def _exit_own(self) -> None:
        try:
            updated = self._ds_modifier_rank is not None
            if updated:
                self._broadcast_own()
            keep = {p.ds_id for p in self._ds_params
                    if p.ds_id in self._fallback_owners
                    and self._fallback_owners[p.ds_id].has_outstanding_graph_claim(p)}
            release = [p for p in self._ds_params if p.ds_id not in keep]
            if updated:  # values changed under a forward graph's claim: the fallback partitions them as updated
                for p in self._ds_params:
                    if p.ds_id in keep:
                        self._fallback_owners[p.ds_id].record_deferred_user_update(p)
            if release:
                release[0].partition(param_list=release, has_been_updated=updated)
        finally:
            for p in self._ds_params:
                depth = _context_depth(p)
                if depth > 1:
                    setattr(p, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR, depth - 1)
                elif hasattr(p, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR):
                    delattr(p, DS_Z3_GATHERED_PARAM_CONTEXT_DEPTH_ATTR)
            for p in self._ds_params:
                owner = self._fallback_owners.get(p.ds_id)
                if owner is not None:
                    owner.release_user_context_claim(p)

    def _broadcast_own(self) -> None:
        """Every rank takes ``modifier_rank``'s values (a rank of each parameter's own group)."""
        from shardwise import comm

        for p in self._ds_params:
            group = getattr(p, "ds_process_group", None)
            if comm.get_world_size(group) > 1:
                src = self._ds_modifier_rank if group is None else \
                    torch.distributed.get_global_rank(group, self._ds_modifier_rank)
                comm.broadcast(p.data, src=src, group=group)
