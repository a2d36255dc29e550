"""``deepspeed`` as a name for shardwise (the opt-in compatibility distribution, compat/deepspeed).

Nothing here trains: ``deepspeed.<name>`` is ``shardwise.<name>``, and importing ``deepspeed.X.Y`` gives
this package's own module of that path if it has one (DeepSpeed's internal names, thin adapters onto
shardwise), else the module ``PATHS`` names (a shardwise module; for ``deepspeed.zero``, as in DeepSpeed,
``deepspeed.runtime.zero``), else ``shardwise.X.Y``, registered under the DeepSpeed name as that same module
object, so ``deepspeed.ops.adam.DeepSpeedCPUAdam is shardwise.ops.adam.DeepSpeedCPUAdam``. Nothing here sets
attributes on shardwise's classes: where DeepSpeed's private methods are needed, this package subclasses
(``DeepSpeedEngine``, which ``deepspeed.initialize`` builds; ``zero.Init``).

Every module of DeepSpeed 0.19.8's Python package imports (``_surface-0.19.8.json`` lists them with their
public names): one that neither this package nor shardwise has is made from that list, and every listed
name a module does not define resolves through ``_surface`` -- to the real object under another of its
DeepSpeed paths, to DeepSpeed's constant value, or to an object that raises ``NotSupportedByShardwise``
("... is not supported by shardwise: <why>") when used, never at import. Paths outside DeepSpeed's tree
that shardwise does not provide fail with shardwise's message saying why. See docs/deepspeed-compat.md.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from importlib import metadata as _metadata
from pathlib import Path

import shardwise as _shardwise
from shardwise import _unsupported

from . import _surface

__shardwise__ = True
DEEPSPEED_API_VERSION = "0.19.8"  # the DeepSpeed release whose names and behaviour shardwise follows
try:
    __version__ = _metadata.version("deepspeed")
except _metadata.PackageNotFoundError:  # imported from a source tree rather than installed
    __version__ = f"{DEEPSPEED_API_VERSION}+shardwise.{_shardwise.__version__}"
version = __version__  # DeepSpeed's top-level `version` is its version string
__version_major__, __version_minor__, __version_patch__ = (int(x) for x in DEEPSPEED_API_VERSION.split("."))
__git_hash__ = None
__git_branch__ = None


class _AliasLoader(importlib.abc.Loader):
    """Hands back the already-imported ``shardwise.X.Y`` module for ``deepspeed.X.Y``."""

    def __init__(self, target: str, dsname: str) -> None:
        self.target = target
        self.dsname = dsname

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._own_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # Already executed as shardwise.X.Y. The import system has just set the alias spec on it:
        # give the module back its own, so it stays shardwise.X.Y to importlib (reload, find_spec).
        module.__spec__ = self._own_spec
        _surface.install(module, self.dsname)


class _FillLoader(importlib.abc.Loader):
    """Runs this package's own module of a DeepSpeed path, then lets DeepSpeed 0.19.8's public names the
    module does not define resolve (``_surface.install``)."""

    def __init__(self, inner, dsname: str) -> None:
        self.inner = inner
        self.dsname = dsname

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = module.__spec__.loader = self.inner  # the file's own loader (source, reload)
        self.inner.exec_module(module)
        _surface.install(module, self.dsname)


class _StubLoader(importlib.abc.Loader):
    """A module of DeepSpeed 0.19.8's tree that neither this package nor shardwise has (``_surface``)."""

    def create_module(self, spec):
        return _surface.stub_module(spec.name)

    def exec_module(self, module) -> None:
        pass


def _stub_spec(fullname: str):
    package = bool(_surface.modules()[fullname].get("package"))
    return importlib.machinery.ModuleSpec(fullname, _StubLoader(), is_package=package)


_HERE = Path(__file__).resolve().parent

# DeepSpeed paths whose module has another name (the rest map deepspeed.X.Y -> shardwise.X.Y).
PATHS: dict[str, str] = {
    "zero": "deepspeed.runtime.zero",  # DeepSpeed's `deepspeed.zero` is its runtime.zero package
    "runtime.activation_checkpointing.checkpointing": "shardwise.checkpointing",  # one module, one set of settings
    "sequence.auto_sp": "shardwise.sequence.autosp.detect",  # AutoSP (docs/sequence-parallel.md)
    "sequence.autosp_vit": "shardwise.sequence.autosp.vit",
}


class _AliasFinder(importlib.abc.MetaPathFinder):
    """``deepspeed.X.Y``: this package's own module of that path if it has one (DeepSpeed's internal
    names, thin adapters), else the shardwise module the path table or the same name points to."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("deepspeed."):
            return None
        parts = fullname.split(".")[1:]
        folder = _HERE.joinpath(*parts[:-1])
        listed = _surface.has_module(fullname)  # a module of DeepSpeed 0.19.8's tree: it must import
        if (folder / parts[-1] / "__init__.py").is_file() or (folder / f"{parts[-1]}.py").is_file():
            spec = importlib.machinery.PathFinder.find_spec(fullname, [str(folder)])
            if spec is not None and listed:
                spec.loader = _FillLoader(spec.loader, fullname)
            return spec
        tail = ".".join(parts)
        real = PATHS.get(tail, "shardwise." + tail)
        reason = _unsupported._reason(real)
        if reason is not None:
            if listed:
                return _stub_spec(fullname)
            raise _unsupported.UnsupportedPathError(f"{fullname} is not supported by shardwise: {reason}. "
                                                    "See docs/deepspeed-compat.md", name=fullname)
        try:
            spec = importlib.util.find_spec(real)
        except ModuleNotFoundError as exc:
            if listed:
                return _stub_spec(fullname)
            if exc.name == real or not real.startswith(exc.name or "?"):
                raise
            return None  # shardwise has no parent package of that name: "No module named 'deepspeed....'"
        if spec is None:
            return _stub_spec(fullname) if listed else None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(real, fullname),
                                              is_package=spec.submodule_search_locations is not None)


if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())

# DeepSpeed's own __init__ imports these, so code may reach them as attributes without importing
# them (accelerate reads `deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES`).
for _name in ("runtime.engine", "runtime.lr_schedules", "runtime.zero.partition_parameters", "runtime.utils",
              "runtime.activation_checkpointing.checkpointing", "checkpoint.utils", "comm.comm", "accelerator",
              "utils", "ops"):
    importlib.import_module("deepspeed." + _name)
del _name


# top-level names of DeepSpeed that live in this package rather than in shardwise
_OWN = {"DeepSpeedConfig": "deepspeed.runtime.config", "DeepSpeedEngine": "deepspeed.runtime.engine",
        "PipelineEngine": "deepspeed.runtime.pipe.engine", "DeepSpeedHybridEngine": "deepspeed.runtime.hybrid_engine"}


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               mpu=None, dist_init_required=None, collate_fn=None, config=None, config_params=None):
    """``shardwise.initialize``, building DeepSpeed's engine classes (``DeepSpeedEngine``, the pipeline's
    ``PipelineEngine``, ``DeepSpeedHybridEngine``): shardwise's engines with DeepSpeed's private helpers."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return _shardwise.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                 training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                 dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                                 config_params=config_params,
                                 engine_classes={"engine": DeepSpeedEngine, "pipeline": PipelineEngine,
                                                 "hybrid": DeepSpeedHybridEngine})


def __getattr__(name: str):
    try:
        return _getattr(name)
    except AttributeError:
        if name.startswith("__") or name not in _surface.names("deepspeed") or _surface._fallback_off():
            raise
    return _surface.resolve("deepspeed", name)  # the rest of DeepSpeed 0.19.8's top-level names (_surface)


def _getattr(name: str):
    if name in _OWN:
        return getattr(importlib.import_module(_OWN[name]), name)
    if name in PATHS:  # `deepspeed.zero`: the module of that DeepSpeed path, as `import deepspeed.zero` gives
        return importlib.import_module(f"deepspeed.{name}")
    try:
        return getattr(_shardwise, name)
    except AttributeError as exc:
        missing = exc
    if name.startswith("__"):
        raise missing
    try:  # DeepSpeed's __init__ imports its subpackages (deepspeed.ops, ...): answer the same way
        return importlib.import_module(f"deepspeed.{name}")
    except ModuleNotFoundError as exc:
        if exc.name in (f"shardwise.{name}", f"deepspeed.{name}"):
            text = str(missing if type(exc) is ModuleNotFoundError else exc)
            raise AttributeError(text.replace("module 'shardwise'", "module 'deepspeed' (shardwise)")) from None
        raise


def __dir__():
    return sorted(set(globals()) | set(dir(_shardwise)))
