"""DeepSpeed 0.19.8's public module tree, answered name by name.

``_surface-0.19.8.json`` (written by compat/tools/ds_surface.py from a real DeepSpeed 0.19.8, the measuring
stick) lists every module of DeepSpeed's Python package that imports on CPU and each module's public names
with their kind. The compat finder (``deepspeed/__init__.py``) uses it so that

* every listed module imports: this package's own module of that path, else the shardwise module of that
  path, else a module made here whose names all answer as below;
* every listed name resolves. A name the module defines itself always wins: the fallback only answers names
  the module does not have, in this order:

  1. the same object elsewhere in the tree: DeepSpeed re-exports a class, function or object from the
     module that defines it (``deepspeed.runtime.engine.DeepSpeedConfig`` is
     ``deepspeed.runtime.config.DeepSpeedConfig``), so the real one is looked up under each of its
     DeepSpeed paths in the compat package and shardwise;
  2. a submodule or a re-imported DeepSpeed module (``dist`` is ``deepspeed.comm``): that module;
  3. a plain constant: DeepSpeed's value (``ADAM_OPTIMIZER == "adam"``);
  4. an exception class: a real exception class of that name (raising and catching it work);
     an enum: a real enum with DeepSpeed's members and values; a name ``_answers.ANSWERS`` implements
     (small functions of shardwise's own modules, availability questions answered False);
  5. anything else, which shardwise has no counterpart for (kernel injection, the fused CUDA kernels,
     FastGen, GDS, the op builders' compiled modules, ...): an object that imports fine and raises
     :class:`NotSupportedByShardwise` -- ``"<name> is not supported by shardwise: <why / what to use>"`` --
     when it is called, instantiated or has an attribute read.
"""
from __future__ import annotations

import enum
import functools
import importlib
import json
import sys
import threading
import types
from pathlib import Path

DATA_FILE = Path(__file__).with_name("_surface-0.19.8.json")
DOCS = "See docs/deepspeed-compat.md"


class NotSupportedByShardwise(NotImplementedError):
    """A DeepSpeed name was used whose feature shardwise does not have (``name``: the DeepSpeed name)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name} is not supported by shardwise: {reason}. {DOCS}")
        self.name = name
        self.reason = reason

    def __reduce__(self):
        # rebuilt from (name, reason), so the error crosses process boundaries (a worker pool's result)
        return type(self), (self.name, self.reason)


class NotSupportedAttributeError(NotSupportedByShardwise, AttributeError):
    """Reading an attribute of a not-supported DeepSpeed name; an ``AttributeError`` too, so ``hasattr``
    and ``getattr(obj, name, default)`` keep working."""


# Why a DeepSpeed module's names have no shardwise counterpart, by module path (without "deepspeed."),
# the longest prefix first; shardwise's own table of unsupported paths (shardwise._unsupported) is read next.
REASONS: dict[str, str] = {
    "inference.v2": "DeepSpeed-FastGen (the inference v2 ragged-batching engine and its CUDA kernels) is a separate "
                    "product shardwise does not implement; use shardwise.init_inference (AutoTP) or `shardwise serve`",
    "inference.quantization": "DeepSpeed-Inference's weight quantisation kernels are not implemented",
    "inference.engine": "DeepSpeed-Inference's kernel-injected engine internals are not implemented; "
                        "deepspeed.init_inference gives shardwise's AutoTP inference engine",
    "model_implementations": "DeepSpeed-Inference's fused CUDA model implementations (kernel injection) are not "
                             "implemented; AutoTP inference (deepspeed.init_inference) runs the Hugging Face modules",
    "module_inject.containers": "kernel-injection policies and containers are not implemented; AutoTP is "
                                "shardwise.tensor_parallel.autotp",
    "module_inject.policy": "kernel-injection policies are not implemented",
    "module_inject.replace_module": "kernel injection (replace_transformer_layer) is not implemented; AutoTP is "
                                    "shardwise.tensor_parallel.autotp",
    "module_inject": "DeepSpeed-Inference's kernel injection is not implemented; AutoTP is "
                     "shardwise.tensor_parallel.autotp",
    "ops.op_builder": "shardwise builds no C++/CUDA extensions (deepspeed.ops' optimizers run on torch's kernels)",
    "ops.transformer.inference": "DeepSpeed-Inference's fused transformer CUDA kernels are not implemented",
    "ops.transformer": "DeepSpeed's fused transformer CUDA kernels are not implemented",
    "ops.gds": "GPUDirect Storage (GDS) handles are not provided (ZeRO's NVMe offload is: zero_optimization.offload_*)",
    "ops.aio": "the raw async-I/O handle is not provided (ZeRO's NVMe offload is: zero_optimization.offload_*)",
    "ops.fp_quantizer": "the FP8/FP6 quantizer kernels are not implemented",
    "ops.quantizer": "the quantization CUDA kernels are not implemented",
    "ops.deepspeed4science": "the DeepSpeed4Science (Evoformer attention) kernels are not implemented",
    "ops.evoformer_attn": "the DeepSpeed4Science (Evoformer attention) kernels are not implemented",
    "ops.compile": "DeepCompile's kernels are not implemented",
    "ops.pin_memory": "the pinned-memory op is not provided: torch's pin_memory() does the same",
    "ops.adam.zenflow": "ZenFlow (stall-free offload) is not implemented",
    "ops.adam.multi_tensor_apply": "the fused multi-tensor apply kernel is not provided (FusedAdam runs torch's "
                                   "foreach kernels)",
    "ops.lion.multi_tensor_apply": "the fused multi-tensor apply kernel is not provided (FusedLion runs torch's "
                                   "foreach kernels)",
    "ops.csrc": "C++/CUDA sources are not Python modules",
    "io": "DeepNVMe's public I/O handles are not provided",
    "nvme": "the NVMe benchmark tools are not provided (ZeRO's NVMe offload is: zero_optimization.offload_*)",
    "compile": "DeepCompile is not implemented; engine.compile() compiles each block with torch.compile "
               "(docs/compile.md)",
    "datastates": "DataStates-LLM asynchronous checkpointing is not implemented; checkpoints are written by "
                  "shardwise.checkpoint",
    "linear": "DeepSpeed's OptimizedLinear / LoRA-quantized linear is not implemented",
    "runtime.domino": "Domino tensor-parallel overlap is not implemented",
    "runtime.zenflow": "ZenFlow (stall-free offload) is not implemented",
    "runtime.superoffload": "SuperOffload is not implemented; ZeRO offload is zero_optimization.offload_*",
    "runtime.zero.muon": "the Muon optimizer is not implemented",
    "runtime.zero.tiling": "TiledLinear is not implemented",
    "runtime.checkpoint_engine": "checkpoints are written by shardwise.checkpoint (safetensors + manifest), not "
                                 "through DeepSpeed's checkpoint engines",
    "runtime.swap_tensor": "ZeRO-Infinity's swapper internals differ: NVMe offload is configured with "
                           "zero_optimization.offload_*",
    "runtime.compiler": "DeepSpeed's compiler helpers are internal; engine.compile() uses torch.compile",
    "runtime.fp16": "DeepSpeed's fp16 optimizer wrappers are internal: the engine builds mixed precision from the "
                    "config's fp16 block",
    "runtime.bf16_optimizer": "DeepSpeed's BF16_Optimizer is internal: the engine builds mixed precision from the "
                              "config's bf16 block",
    "runtime.zero.stage3": "ZeRO-3's optimizer internals differ: the engine builds ZeRO-3 from the config "
                           "(deepspeed.zero.Init / GatheredParameters are provided)",
    "runtime.zero.stage_1_and_2": "ZeRO-1/2's optimizer internals differ: the engine builds them from the config",
    "runtime.zero.partitioned_param_coordinator": "ZeRO-3's prefetch coordinator internals differ",
    "runtime.zero": "this ZeRO internal has no counterpart: the engine builds ZeRO from the config",
    "runtime.pipe": "this pipeline-engine internal has no counterpart in shardwise.pipe",
    "accelerator": "only the CPU and CUDA accelerators are provided (deepspeed.accelerator.get_accelerator)",
    "autotuning": "use `shardwise autotune` (or `shardwise run --autotuning tune`)",
    "elasticity": "use `shardwise run --elastic MIN:MAX` (torch's elastic agent)",
    "launcher": "use `shardwise run` (the `deepspeed` command is shardwise's launcher)",
    "env_report": "use `shardwise doctor`",
    "comm.ccl": "the oneCCL backend is not provided (torch.distributed's gloo/nccl are)",
    "comm.mpi": "the MPI comm backend is not provided (torch.distributed's gloo/nccl are)",
    "comm.hccl": "the HCCL backend is not provided (torch.distributed's gloo/nccl are)",
    "moe": "this MoE internal has no counterpart in shardwise.moe",
    "sequence": "this sequence-parallel internal has no counterpart in shardwise.sequence",
    "profiling": "this profiler internal has no counterpart: the flops profiler is shardwise.profiling.flops_profiler",
    "monitor": "this monitor internal has no counterpart: the engine builds the monitors from the config",
    "checkpoint": "this checkpoint-conversion internal has no counterpart: shardwise.checkpoint reads and writes "
                  "DeepSpeed's layout",
}
DEFAULT_REASON = "a DeepSpeed internal with no counterpart in shardwise, which implements the feature another way"


def reason_for(module: str) -> str:
    rel = module.removeprefix("deepspeed").lstrip(".")
    parts = rel.split(".") if rel else []
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in REASONS:
            return REASONS[".".join(parts[:i])]
    try:
        from shardwise import _unsupported
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in _unsupported.NOT_SUPPORTED:
                return _unsupported.NOT_SUPPORTED[".".join(parts[:i])]
    except ImportError:
        pass
    return DEFAULT_REASON


@functools.cache
def data() -> dict:
    with open(DATA_FILE) as f:
        return json.load(f)


def modules() -> dict:
    return data()["modules"]


def has_module(name: str) -> bool:
    return name in modules()


def names(module: str) -> dict:
    entry = modules().get(module)
    return entry["names"] if entry else {}


@functools.cache
def _groups() -> dict[str, list[tuple[str, str]]]:
    """Object -> every (module, name) of the tree that holds it (key: where it is defined, else first holder)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for mod, entry in modules().items():
        for name, d in entry["names"].items():
            out.setdefault(_key(mod, name, d), []).append((mod, name))
    return out


def _key(mod: str, name: str, d: dict) -> str:
    return d.get("origin") or d.get("same") or f"{mod}:{name}"


# ---------------------------------------------------------------------------------------------- stubs

_STUB = "__shardwise_not_supported__"  # set on every object made here for a not-supported name


def is_stub(obj) -> bool:
    try:
        return bool(obj.__dict__.get(_STUB)) if isinstance(obj, (type, types.FunctionType, types.ModuleType)) \
            else isinstance(obj, _StubObject)
    except AttributeError:
        return False


class _StubMeta(type):
    """Class of a not-supported DeepSpeed class: importable, subclassable and usable in ``isinstance``;
    instantiating it, or reading a public attribute it does not define, raises."""

    def __call__(cls, *args, **kwargs):
        raise NotSupportedByShardwise(cls.__dict__.get("_ds_name", cls.__qualname__), cls._ds_reason)

    def __getattr__(cls, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        raise NotSupportedAttributeError(f"{cls._ds_name}.{attr}", cls._ds_reason)


class _StubObject:
    """A not-supported DeepSpeed module-level object (a policy list, a kernel handle, ...)."""

    def __init__(self, name: str, reason: str) -> None:
        object.__setattr__(self, "_ds_name", name)
        object.__setattr__(self, "_ds_reason", reason)

    def _raise(self, what=""):
        raise NotSupportedByShardwise(self._ds_name + what, self._ds_reason)

    def __getattr__(self, attr):
        if attr.startswith("_"):
            raise AttributeError(attr)
        raise NotSupportedAttributeError(f"{self._ds_name}.{attr}", self._ds_reason)

    def __call__(self, *args, **kwargs):
        self._raise("()")

    def __getitem__(self, key):
        self._raise(f"[{key!r}]")

    def __iter__(self):
        self._raise()

    def __len__(self):
        self._raise()

    def __contains__(self, item):
        self._raise()

    def __repr__(self):
        return f"<{self._ds_name}: not supported by shardwise>"


def _stub_function(module: str, qualname: str, reason: str):
    full = f"{module}.{qualname}"

    def not_supported(*args, **kwargs):
        raise NotSupportedByShardwise(full, reason)

    not_supported.__name__ = qualname.rsplit(".", 1)[-1]
    not_supported.__qualname__ = qualname
    not_supported.__module__ = module
    not_supported.__doc__ = f"DeepSpeed's {full}: not supported by shardwise ({reason})."
    setattr(not_supported, _STUB, True)
    return not_supported


def _stub_class(module: str, qualname: str, reason: str) -> type:
    full = f"{module}.{qualname}"
    return _StubMeta(qualname.rsplit(".", 1)[-1], (), {
        "__module__": module, "__qualname__": qualname, "_ds_name": full, "_ds_reason": reason, _STUB: True,
        "__doc__": f"DeepSpeed's {full}: not supported by shardwise ({reason})."})


def _exception_class(module: str, qualname: str) -> type:
    return type(qualname.rsplit(".", 1)[-1], (Exception,), {
        "__module__": module, "__qualname__": qualname, "__doc__": f"DeepSpeed's {module}.{qualname}."})


def _enum_class(module: str, qualname: str, info: dict) -> type:
    base = {"IntEnum": enum.IntEnum, "Flag": enum.Flag, "IntFlag": enum.IntFlag}.get(info["type"], enum.Enum)
    members = [(k, tuple(v) if isinstance(v, list) else v) for k, v in info["members"]]
    if info["type"] == "str":
        cls = enum.Enum(qualname.rsplit(".", 1)[-1], members, module=module, qualname=qualname, type=str)
    elif info["type"] == "int":
        cls = enum.Enum(qualname.rsplit(".", 1)[-1], members, module=module, qualname=qualname, type=int)
    else:
        cls = base(qualname.rsplit(".", 1)[-1], members, module=module, qualname=qualname)
    return cls


def _value(d: dict):
    v = d["value"]
    t = d.get("type")
    if t == "tuple":
        return tuple(v)
    if t == "set":
        return set(v)
    if t == "frozenset":
        return frozenset(v)
    return v


# ------------------------------------------------------------------------------------------ resolving

_lock = threading.RLock()
_made: dict[str, object] = {}  # group key -> the object made for it (one object for all its paths)
_resolved: dict[tuple[str, str], object] = {}  # (module, name) -> what it resolved to (stable identity)
_state = threading.local()


def _fallback_off() -> bool:
    return getattr(_state, "off", 0) > 0


def _real_attr(module: str, name: str):
    """``module.name`` from the compat package or shardwise, not from this fallback; None when absent."""
    mod = sys.modules.get(module)
    if mod is None:
        try:
            mod = importlib.import_module(module)
        except Exception:  # noqa: BLE001 -- a path that does not import has no real object
            return None
    if mod.__dict__.get(_STUB):
        return None
    _state.off = getattr(_state, "off", 0) + 1
    try:
        obj = getattr(mod, name)
    except Exception:  # noqa: BLE001
        return None
    finally:
        _state.off -= 1
    return None if is_stub(obj) else obj


def _foreign(ref: str):
    mod, _, qual = ref.partition(":")
    obj = importlib.import_module(mod)
    for part in filter(None, qual.split(".")):
        obj = getattr(obj, part)
    return obj


def resolve(module: str, name: str):
    """The object the compat package answers for DeepSpeed's ``module.name`` when ``module`` does not define
    it; ``AttributeError`` when DeepSpeed 0.19.8 has no such public name either."""
    d = names(module).get(name)
    if d is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    with _lock:
        if (module, name) not in _resolved:
            _resolved[(module, name)] = _resolve(module, name, d)
        return _resolved[(module, name)]


def _resolve(module: str, name: str, d: dict):
    kind = d["kind"]
    if "foreign" in d:
        return importlib.import_module(d["foreign"]) if kind == "module" else _foreign(d["foreign"])
    if kind == "module":
        try:
            return importlib.import_module(d["target"])
        except Exception as exc:  # noqa: BLE001 -- answer with a stub that says why
            return _StubObject(d["target"], f"the module does not import ({type(exc).__name__}: {exc})")
    if kind == "constant" and "value" in d:
        return _value(d)
    key = _key(module, name, d)
    home = tuple(key.split(":", 1))
    from ._answers import ANSWERS

    for slot in [home, (module, name), *_groups().get(key, [])]:
        if slot in ANSWERS:
            return ANSWERS[slot]
    if key in _made:
        return _made[key]
    home = tuple(key.split(":", 1))
    for m, n in [home, *_groups().get(key, [])]:
        if (m, n) == (module, name) or "." in n:
            continue
        real = _real_attr(m, n)
        if real is not None and (kind == "module") == isinstance(real, types.ModuleType):
            return real  # (a package's submodule attribute can shadow a class of the same name: not that)
    obj = _make(home[0], home[1], d)
    _made[key] = obj
    return obj


def _make(module: str, qualname: str, d: dict):
    reason = reason_for(module)
    kind = d["kind"]
    if kind == "class":
        if d.get("exception"):
            return _exception_class(module, qualname)
        if d.get("enum"):
            try:
                return _enum_class(module, qualname, d["enum"])
            except (TypeError, ValueError):  # members enum's functional API cannot rebuild
                pass
        return _stub_class(module, qualname, reason)
    if kind == "function":
        return _stub_function(module, qualname, reason)
    return _StubObject(f"{module}.{qualname}", reason)


# ---------------------------------------------------------------------------------- module fallbacks

def install(module: types.ModuleType, dsname: str) -> None:
    """Give ``module`` (imported as DeepSpeed's ``dsname``) a module ``__getattr__`` that answers DeepSpeed's
    public names it does not define, after its own ``__getattr__`` if it has one."""
    if not names(dsname):
        return
    current = module.__dict__.get("__getattr__")
    paths = getattr(current, "_ds_paths", None)
    if paths is not None:
        if dsname not in paths:
            paths.append(dsname)
        return
    own = current
    paths = [dsname]

    def __getattr__(name: str):
        if own is not None:
            try:
                return own(name)
            except AttributeError as exc:
                error = exc
        else:
            error = AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        if _fallback_off() or name.startswith("__"):
            raise error
        for path in paths:
            if name in names(path):
                return resolve(path, name)
        raise error

    __getattr__._ds_paths = paths
    module.__getattr__ = __getattr__


def stub_module(fullname: str) -> types.ModuleType:
    """A module for DeepSpeed's ``fullname`` where neither this package nor shardwise has one: every public
    name of DeepSpeed's module resolves (see the module docstring), and nothing raises at import."""
    entry = modules()[fullname]
    reason = reason_for(fullname)
    mod = types.ModuleType(fullname, f"DeepSpeed's {fullname}: not supported by shardwise ({reason}). "
                                     "Its names import; using them raises NotSupportedByShardwise.")
    mod.__dict__[_STUB] = True
    if entry.get("package"):
        mod.__path__ = []
    if "all" in entry:
        mod.__all__ = list(entry["all"])

    def __getattr__(name: str):
        if name.startswith("__") or name not in entry["names"]:
            raise AttributeError(f"module {fullname!r} has no attribute {name!r}")
        if _fallback_off():
            raise AttributeError(name)
        return resolve(fullname, name)

    mod.__getattr__ = __getattr__
    mod.__dir__ = lambda: sorted(set(mod.__dict__) | set(entry["names"]))
    return mod
