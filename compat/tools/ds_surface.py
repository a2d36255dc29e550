#!/usr/bin/env python3
"""ds_surface.py -- list DeepSpeed's public Python surface: every importable module and its public names.

Run it with the interpreter of an environment where real DeepSpeed is installed (a throwaway venv; DeepSpeed
is a measuring stick for the compat package, never a dependency of shardwise). It needs no network:

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0
    /tmp/dsvenv/bin/pip install --no-deps deepspeed==0.19.8 hjson ninja psutil py-cpuinfo msgpack pydantic \
        pydantic-core annotated-types typing-inspection packaging tqdm numpy einops
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python compat/tools/ds_surface.py \
        compat/deepspeed/deepspeed/_surface-0.19.8.json

What counts
-----------
Modules: every ``.py`` file of the installed ``deepspeed`` package (its C++/CUDA sources are not Python
modules), imported one by one in sorted order in one process, DeepSpeed's CPU accelerator selected and only
DeepSpeed's own install requirements present. A module that fails to import under DeepSpeed itself there
(it needs triton, CUDA, transformers, a compiled op, ...) is listed under ``"failed"`` with the error, not
under ``"modules"``.

Public names of a module: the names of ``dir(module)`` that do not start with ``_``, plus every name of the
module's ``__all__``, less what the module merely re-imports from outside DeepSpeed:
  * a module object counts only if it is a DeepSpeed module (``dist``, ``groups``; not ``torch``, ``os``);
  * a class or function counts only if its ``__module__`` is in DeepSpeed (not ``Optional``, ``nn.Module``);
  * any other object counts unless it is also a top-level attribute of a non-DeepSpeed module (so
    ``torch.float16`` or ``typing.Any`` re-imported under their own names do not count, while
    ``ADAM_OPTIMIZER = "adam"`` or ``logger`` do). Plain values (str, int, float, bool, None, and tuples,
    lists, sets and dicts of them) always count.

Each name has a kind, ``module`` / ``class`` / ``function`` / ``constant``, and what lets the compat package
answer for it without DeepSpeed:
  * module: ``"target"``, the DeepSpeed module it is;
  * class / function: ``"origin"``, where it is defined (``module:qualname``) when that is elsewhere;
    classes also ``"exception": true`` for exception classes and ``"enum"`` (its kind and its
    ``[name, value]`` members in order) for enums;
  * constant: ``"value"`` (and ``"type"`` for tuple/set/frozenset) when it is a plain JSON-able value,
    else ``"type"`` (the class of the object) and ``"same"``: the first (module, name) that holds the
    same object, so a re-export resolves to where the compat package has the real one.

Output: ``{"deepspeed_version", "python", "torch", "modules": {module: {"package": bool, "all": [...]?,
"names": {name: {...}}}}, "failed": {module: error}}`` (sorted, one module a block).
"""
from __future__ import annotations

import contextlib
import enum
import importlib
import inspect
import io
import json
import math
import os
import pkgutil
import signal
import sys
import warnings

PLAIN = (str, int, float, bool, type(None), bytes)


def _is_plain(v, depth=0) -> bool:
    if depth > 4:
        return False
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, PLAIN) and not isinstance(v, bytes):
        return True
    if type(v) in (tuple, list, set, frozenset):
        return all(_is_plain(x, depth + 1) for x in v)
    if type(v) is dict:
        return all(isinstance(k, str) and _is_plain(x, depth + 1) for k, x in v.items())
    return False


def _jsonable(v):
    if isinstance(v, (tuple, list)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted((_jsonable(x) for x in v), key=repr)
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _own_module(name) -> bool:
    return isinstance(name, str) and (name == "deepspeed" or name.startswith("deepspeed."))


def _module_names(pkg) -> list[str]:
    names = [pkg.__name__]
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".", onerror=lambda n: None):
        names.append(info.name)
    # walk_packages imports packages to look inside them; list the files too so a package that fails to
    # import still has its submodules listed (as failing)
    root = os.path.dirname(pkg.__file__)
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if os.path.isfile(os.path.join(dirpath, d, "__init__.py"))]
        rel = os.path.relpath(dirpath, root)
        base = pkg.__name__ if rel == "." else pkg.__name__ + "." + rel.replace(os.sep, ".")
        for f in filenames:
            if f.endswith(".py"):
                names.append(base if f == "__init__.py" else f"{base}.{f[:-3]}")
    return sorted(set(names))


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout("import took over 120 s")


def _import_all(names):
    modules, failed = {}, {}
    signal.signal(signal.SIGALRM, _alarm)
    for name in names:
        signal.alarm(120)
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                modules[name] = importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 -- anything a module raises at import means "fails"
            if isinstance(exc, KeyboardInterrupt):
                raise
            failed[name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        finally:
            signal.alarm(0)
    return modules, failed


def _foreign_ids() -> set[int]:
    ids = set()
    for name, mod in list(sys.modules.items()):
        if mod is None or _own_module(name):
            continue
        try:
            values = list(vars(mod).values())
        except TypeError:
            continue
        ids.update(id(v) for v in values if not _is_plain(v))
    return ids


def _enum_info(cls):
    members = []  # [name, value] pairs in definition order (aliases left out, as iteration does)
    for m in cls:
        if not _is_plain(m.value):
            return None
        members.append([m.name, _jsonable(m.value)])
    for base, tag in ((enum.IntFlag, "IntFlag"), (enum.Flag, "Flag"), (enum.IntEnum, "IntEnum")):
        if issubclass(cls, base):
            return {"type": tag, "members": members}
    return {"type": "str" if issubclass(cls, str) else "int" if issubclass(cls, int) else "Enum",
            "members": members}


def _describe(modname, name, obj, foreign, holders):
    if inspect.ismodule(obj):
        if not _own_module(obj.__name__):
            return None
        return {"kind": "module", "target": obj.__name__}
    if inspect.isclass(obj) or inspect.isroutine(obj):
        owner = getattr(obj, "__module__", None)
        if not _own_module(owner):
            return None
        d = {"kind": "class" if inspect.isclass(obj) else "function"}
        qual = getattr(obj, "__qualname__", name)
        if "<" not in qual:
            if (owner, qual) != (modname, name):
                d["origin"] = f"{owner}:{qual}"
        else:  # made by a decorator or factory (timed_op's log_wrapper): link the paths that hold it instead
            first = holders.setdefault(id(obj), (modname, name))
            if first != (modname, name):
                d["same"] = f"{first[0]}:{first[1]}"
        if inspect.isclass(obj):
            if issubclass(obj, BaseException):
                d["exception"] = True
            if issubclass(obj, enum.Enum):
                info = _enum_info(obj)
                if info:
                    d["enum"] = info
        return d
    if _is_plain(obj):
        d = {"kind": "constant", "value": _jsonable(obj)}
        if type(obj) in (tuple, set, frozenset):
            d["type"] = type(obj).__name__
        return d
    if id(obj) in foreign:
        return None
    t = type(obj)
    d = {"kind": "function" if callable(obj) and not isinstance(obj, type) and t.__name__ in (
        "partial", "builtin_function_or_method", "method") else "constant",
         "type": f"{t.__module__}.{t.__qualname__}"}
    first = holders.setdefault(id(obj), (modname, name))
    if first != (modname, name):
        d["same"] = f"{first[0]}:{first[1]}"
    return d


def main(argv):
    if len(argv) != 2:
        sys.exit("usage: DS_ACCELERATOR=cpu python ds_surface.py OUT.json")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore")
    import deepspeed

    torch = sys.modules.get("torch")  # DeepSpeed imports it; recorded for the record only

    names = _module_names(deepspeed)
    modules, failed = _import_all(names)
    foreign = _foreign_ids()
    holders: dict[int, tuple[str, str]] = {}
    out = {}
    for modname in sorted(modules):
        mod = modules[modname]
        declared = getattr(mod, "__all__", None)
        candidates = {n for n in dir(mod) if not n.startswith("_")}
        if isinstance(declared, (list, tuple)):
            candidates |= {n for n in declared if isinstance(n, str)}
        entry = {"package": hasattr(mod, "__path__")}
        if isinstance(declared, (list, tuple)):
            entry["all"] = [n for n in declared if isinstance(n, str)]
        described = {}
        for n in sorted(candidates):
            try:
                obj = getattr(mod, n)
            except Exception:  # noqa: BLE001 -- a lazy attribute that fails on CPU is not a usable name
                continue
            in_all = isinstance(declared, (list, tuple)) and n in declared
            d = _describe(modname, n, obj, foreign, holders)
            if d is None and in_all:  # declared public although re-imported: keep, with where it comes from
                d = {"kind": "module" if inspect.ismodule(obj) else "class" if inspect.isclass(obj) else
                     "function" if callable(obj) else "constant"}
                ref = getattr(obj, "__name__", None) if inspect.ismodule(obj) else \
                    f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"
                d["foreign"] = ref
            if d is not None:
                described[n] = d
        entry["names"] = described
        out[modname] = entry
    data = {"deepspeed_version": deepspeed.__version__, "python": sys.version.split()[0],
            "torch": getattr(torch, "__version__", None), "accelerator": os.environ["DS_ACCELERATOR"],
            "modules": out, "failed": dict(sorted(failed.items()))}
    with open(argv[1], "w") as f:
        f.write("{\n")
        keys = list(data)
        for i, k in enumerate(keys):
            sep = "," if i < len(keys) - 1 else ""
            if k in ("modules", "failed"):
                f.write(f" {json.dumps(k)}: {{\n")
                items = list(data[k].items())
                for j, (m, v) in enumerate(items):
                    f.write(f"  {json.dumps(m)}: {json.dumps(v, sort_keys=True)}{',' if j < len(items) - 1 else ''}\n")
                f.write(f" }}{sep}\n")
            else:
                f.write(f" {json.dumps(k)}: {json.dumps(data[k])}{sep}\n")
        f.write("}\n")
    n_names = sum(len(e["names"]) for e in out.values())
    print(f"{len(out)} modules, {n_names} public names, {len(failed)} modules failed to import -> {argv[1]}")


if __name__ == "__main__":
    main(sys.argv)
