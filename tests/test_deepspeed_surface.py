"""DeepSpeed 0.19.8's whole public module tree through the compat package (compat/deepspeed).

``compat/deepspeed/deepspeed/_surface-0.19.8.json`` lists every module of DeepSpeed's Python package that
imports on CPU and each one's public names (written by compat/tools/ds_surface.py from a real DeepSpeed, which
these tests never need). One subprocess imports every listed module through the compat package, resolves
every listed name, and checks what each resolves to: DeepSpeed's value for a constant, a real class for an
exception or enum, and, for what shardwise does not have, an object that raised nothing at import and raises
``NotSupportedByShardwise`` naming itself when called, instantiated or read.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPAT = REPO / "compat" / "deepspeed"
DATA = COMPAT / "deepspeed" / "_surface-0.19.8.json"


def _run(code: str, *args: str, extra_path: tuple[str, ...] = (), timeout: int = 300) -> str:
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([*extra_path, str(REPO), str(COMPAT)]))
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


_WHOLE_TREE = r"""
import enum, importlib, inspect, json, sys, types
import deepspeed
from deepspeed import _surface
from deepspeed._surface import NotSupportedByShardwise
assert deepspeed.__file__.startswith(sys.argv[1]), deepspeed.__file__  # the compat package, not a DeepSpeed
data = _surface.data()
assert data["deepspeed_version"] == "0.19.8" and len(data["modules"]) > 700

def norm(v):
    if isinstance(v, (tuple, list)):
        return [norm(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return sorted((norm(x) for x in v), key=repr)
    if isinstance(v, dict):
        return {k: norm(x) for k, x in v.items()}
    if v is None or isinstance(v, (str, int, float, bool)):
        return v
    return ("object", type(v).__name__)

def raises_named(fn, name):
    try:
        fn()
    except NotSupportedByShardwise as exc:
        assert "is not supported by shardwise: " in str(exc) and exc.name.startswith(name), (name, str(exc))
        return True
    return False

ENVIRONMENT = {"version", "git_hash", "git_branch", "installed_ops", "compatible_ops", "torch_info",
               "accelerator_name"}
# deepspeed/utils/__init__.py rebinds its submodule's name to the class tensor_fragment; importing the
# submodule (which shardwise's deepspeed.utils does) binds the module, as Python does for any package
KNOWN = {"deepspeed.utils.tensor_fragment"}
import_failed, name_failed, wrong, counts = {}, {}, [], dict(real=0, stub=0, constant=0)
for modname, entry in data["modules"].items():
    try:
        mod = importlib.import_module(modname)
    except BaseException as exc:
        import_failed[modname] = f"{type(exc).__name__}: {exc}"[:300]
        continue
    for name, d in entry["names"].items():
        try:
            obj = getattr(mod, name)
        except BaseException as exc:
            name_failed[f"{modname}.{name}"] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        where = f"{modname}.{name}"
        kind = d["kind"]
        if kind == "module":
            if not isinstance(obj, types.ModuleType):
                wrong.append((where, "not a module"))
            continue
        if kind == "constant" and "value" in d and "foreign" not in d:
            counts["constant"] += 1
            if name in ENVIRONMENT:  # describes the installation (versions, build), not DeepSpeed's API
                if type(obj) is not type(_surface._value(d)) and obj is not None:
                    wrong.append((where, f"{type(obj).__name__} where DeepSpeed has {type(d['value']).__name__}"))
                continue
            if norm(obj) != norm(_surface._value(d)):
                wrong.append((where, f"value {obj!r} != DeepSpeed's {d['value']!r}"[:300]))
            continue
        if not _surface.is_stub(obj):
            counts["real"] += 1
            if kind == "class" and not callable(obj) and where not in KNOWN:
                wrong.append((where, f"a class in DeepSpeed, {type(obj).__name__} here"))
            if d.get("exception") and not (inspect.isclass(obj) and issubclass(obj, BaseException)):
                wrong.append((where, "an exception class in DeepSpeed, not here"))
            if d.get("enum") and inspect.isclass(obj) and issubclass(obj, enum.Enum) and _surface.is_stub(mod):
                if [[m.name, m.value] for m in obj] != [[k, tuple(v) if isinstance(v, list) else v]
                                                        for k, v in d["enum"]["members"]]:
                    wrong.append((where, "enum members differ"))
            continue
        counts["stub"] += 1
        if kind == "class":
            ok = raises_named(obj, obj._ds_name) and raises_named(lambda: obj.some_attribute, obj._ds_name)
            ok = ok and not hasattr(obj, "some_attribute")  # an AttributeError too: hasattr/getattr default work
            ok = ok and isinstance(type("Sub", (obj,), {}), type)  # subclassing at import is fine
        elif kind == "function":
            ok = raises_named(obj, obj.__module__)
        else:
            ok = raises_named(lambda: obj.some_attribute, obj._ds_name) and raises_named(obj, obj._ds_name)
        if not ok:
            wrong.append((where, "a stub that does not raise NotSupportedByShardwise when used"))
print(json.dumps({"import_failed": import_failed, "name_failed": name_failed, "wrong": wrong, "counts": counts}))
"""


@pytest.fixture(scope="module")
def probe() -> list[str]:
    """One interpreter for both checks: the whole tree, then the spot checks (which print "ok")."""
    return _run(_WHOLE_TREE + _SPOT, str(COMPAT)).strip().splitlines()


def test_every_module_imports_and_every_public_name_resolves(probe):
    out = json.loads(probe[-2])
    assert out["import_failed"] == {}
    assert out["name_failed"] == {}
    assert out["wrong"] == []
    counts = out["counts"]
    data = json.loads(DATA.read_text())
    total = sum(len(e["names"]) for e in data["modules"].values())
    assert counts["constant"] > 3000 and counts["real"] > 1000 and counts["stub"] > 1000, counts
    assert sum(counts.values()) <= total


_SPOT = r"""
import enum, sys, pytest
import deepspeed, shardwise
from deepspeed._surface import NotSupportedByShardwise, NotSupportedAttributeError
# importing the names of features shardwise lacks never raises; using them does, saying what and why
from deepspeed.inference.v2 import build_hf_engine, RaggedInferenceEngineConfig
from deepspeed.module_inject.containers import HFGPT2LayerPolicy
from deepspeed.ops.op_builder import GDSBuilder, InferenceBuilder
import deepspeed.runtime.domino.transformer
with pytest.raises(NotSupportedByShardwise, match=r"deepspeed\.inference\.v2\..*build_hf_engine is not supported by "
                                                  r"shardwise: DeepSpeed-FastGen"):
    build_hf_engine("model")
with pytest.raises(NotSupportedByShardwise, match="RaggedInferenceEngineConfig is not supported by shardwise"):
    RaggedInferenceEngineConfig()
with pytest.raises(NotSupportedByShardwise, match="kernel-injection"):
    HFGPT2LayerPolicy(None)
class MyPolicy(HFGPT2LayerPolicy):  # a project's subclass still imports
    pass
assert issubclass(MyPolicy, HFGPT2LayerPolicy) and not isinstance(object(), HFGPT2LayerPolicy)
with pytest.raises(NotSupportedAttributeError, match="HFGPT2LayerPolicy.get_hidden_heads"):
    HFGPT2LayerPolicy.get_hidden_heads
with pytest.raises(NotImplementedError, match="C\\+\\+/CUDA"):
    GDSBuilder().load()
# the error survives pickling (a worker pool hands a rank's exception to its parent)
import pickle
try:
    build_hf_engine("model")
except NotSupportedByShardwise as exc:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is NotSupportedByShardwise and str(back) == str(exc) and back.name == exc.name
try:
    HFGPT2LayerPolicy.get_hidden_heads
except NotSupportedAttributeError as exc:
    assert type(pickle.loads(pickle.dumps(exc))) is NotSupportedAttributeError
# DeepSpeed's constants with DeepSpeed's values
from deepspeed.runtime.config import ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER
from deepspeed.runtime.constants import GRADIENT_ACCUMULATION_STEPS
assert (ADAM_OPTIMIZER, ADAMW_OPTIMIZER, LAMB_OPTIMIZER) == ("adam", "adamw", "lamb")
assert GRADIENT_ACCUMULATION_STEPS == "gradient_accumulation_steps"
# a re-export is the real object of the module that defines it
import deepspeed.runtime.engine as engine, deepspeed.runtime.config as config
assert engine.DeepSpeedConfig is config.DeepSpeedConfig
from deepspeed.moe.layer import groups
from deepspeed.utils import groups as utils_groups
assert groups is utils_groups
# exception classes are real: raised and caught as DeepSpeed's code does
from deepspeed.utils.exceptions import DeprecatedException
assert issubclass(DeprecatedException, Exception)
with pytest.raises(DeprecatedException):
    raise DeprecatedException("old")
# an enum shardwise has no class for is a real enum with DeepSpeed's members in DeepSpeed's order
from deepspeed.utils.types import NormType
from deepspeed.runtime.domino.transformer import AttnType
assert issubclass(NormType, enum.Enum) and [(m.name, m.value) for m in NormType] == \
    [("UNKNOWN", 0), ("LayerNorm", 1), ("GroupNorm", 2), ("RMSNorm", 3)] and NormType.RMSNorm == 3
assert AttnType.self_attn.value == 1 and AttnType(2) is AttnType.cross_attn
# what a module defines itself always wins over the list: the fallback only fills what is missing
import deepspeed.runtime.zero.partition_parameters as pp
assert issubclass(pp.Init, shardwise.zero.Init) and pp.Init.__module__ == pp.__name__ \
    and pp.GatheredParameters.__module__ == pp.__name__ \
    and issubclass(pp.GatheredParameters, shardwise.zero.GatheredParameters)
# DeepSpeed's `deepspeed.zero` is its runtime.zero package, by attribute and by import
import deepspeed.zero
assert deepspeed.zero is sys.modules["deepspeed.runtime.zero"] and deepspeed.zero.Init is pp.Init \
    and deepspeed.zero.GatheredParameters is pp.GatheredParameters
# names DeepSpeed 0.19.8 does not have are still an AttributeError
with pytest.raises(AttributeError):
    deepspeed.runtime.config.NO_SUCH_NAME
with pytest.raises(AttributeError):
    deepspeed.no_such_name
print("ok")
"""


def test_stubs_raise_when_used_and_real_names_win(probe):
    assert probe[-1] == "ok"


_FAKE = {
    "__init__.py": "from . import sub\nfrom .sub import Thing\nVERSION = '1.0'\n__version__ = VERSION\n",
    "sub.py": textwrap.dedent("""
        import os, logging
        from typing import Optional
        from enum import Enum
        from collections import OrderedDict as OD
        A_CONSTANT = "adam"
        PAIR = (1, 2)
        logger = logging.getLogger("fake")
        _private = 1
        class Thing: pass
        class Failure(ValueError): pass
        class Color(Enum):
            RED = "r"
            BLUE = "b"
        def helper(x: Optional[int]): return x
        from logging import root
        """),
    "broken.py": "raise RuntimeError('needs a GPU')\n",
}


def test_generator_rule_on_a_small_package(tmp_path):
    """compat/tools/ds_surface.py's rule, on a stand-in package named deepspeed (real DeepSpeed not needed)."""
    pkg = tmp_path / "fake" / "deepspeed"
    pkg.mkdir(parents=True)
    for name, text in _FAKE.items():
        (pkg / name).write_text(text)
    out = tmp_path / "surface.json"
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=str(tmp_path / "fake"))
    proc = subprocess.run([sys.executable, str(REPO / "compat" / "tools" / "ds_surface.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["failed"] == {"deepspeed.broken": "RuntimeError: needs a GPU"}
    top, sub = data["modules"]["deepspeed"], data["modules"]["deepspeed.sub"]
    assert top["package"] and not sub["package"]
    assert top["names"] == {"VERSION": {"kind": "constant", "value": "1.0"},
                            "sub": {"kind": "module", "target": "deepspeed.sub"},
                            "Thing": {"kind": "class", "origin": "deepspeed.sub:Thing"}}
    # re-imported modules (os, logging), classes and functions from outside (Optional, Enum, OD) and objects
    # that are another package's attributes (logging.root) do not count; private names do not either
    assert sorted(sub["names"]) == ["A_CONSTANT", "Color", "Failure", "PAIR", "Thing", "helper", "logger"]
    assert sub["names"]["PAIR"] == {"kind": "constant", "value": [1, 2], "type": "tuple"}
    assert sub["names"]["Failure"] == {"kind": "class", "exception": True}
    assert sub["names"]["Color"]["enum"] == {"type": "Enum", "members": [["RED", "r"], ["BLUE", "b"]]}
    assert sub["names"]["logger"] == {"kind": "constant", "type": "logging.Logger"}
    assert sub["names"]["helper"] == {"kind": "function"}
