"""The boundary between shardwise and its DeepSpeed compatibility package (compat/deepspeed), as a rule.

* ``shardwise/`` never imports ``deepspeed`` (the compat package depends on shardwise, never the reverse).
* Nothing in compat sets attributes on shardwise's classes or modules: no ``X.attr = ...``, ``del X.attr``
  or ``setattr(X, ...)`` where ``X`` was imported from shardwise. Where DeepSpeed's private methods are
  needed, compat subclasses (``deepspeed.runtime.engine.DeepSpeedEngine``).
* compat holds names, signatures and DeepSpeed's file formats, no numerics: no tensor math (``torch``
  functions, ``torch.nn.functional``, tensor methods that compute) outside ``NUMERICS_ALLOWED``, each
  entry with the reason it is not a computation shardwise should own.

Everything is read with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARDWISE = ROOT / "shardwise"
COMPAT = ROOT / "compat" / "deepspeed" / "deepspeed"

# Calls that compute on tensor values: ``torch.<name>(...)`` / ``F.<name>(...)`` for the names in ``MATH``, and
# ``<tensor>.<name>(...)`` for those in ``TENSOR_MATH``. (Moving, viewing, cloning and casting tensors is not
# numerics, nor is handing a tensor to a shardwise collective: a file format reads and writes tensors.)
TENSOR_MATH = frozenset({
    "abs", "add_", "addmm", "baddbmm", "bmm", "clamp", "clamp_", "cumsum", "div", "div_", "dot", "exp", "exp_",
    "log", "log_softmax", "matmul", "mean", "mm", "mul", "mul_", "norm", "pow", "pow_", "prod", "rsqrt", "softmax",
    "sqrt", "sqrt_", "sub_", "sum", "topk", "argmax",
})
MATH = TENSOR_MATH | frozenset({
    "add", "sub", "einsum", "linear", "vector_norm", "conv1d", "conv2d", "gelu", "relu", "silu", "dropout",
    "cross_entropy", "layer_norm", "scaled_dot_product_attention",
})
_TORCH_ROOTS = frozenset({"torch", "F", "functional"})

# compat modules allowed some of the calls above, and why (relative to compat/deepspeed/deepspeed).
NUMERICS_ALLOWED: dict[str, str] = {
    "runtime/zero/linear.py": "DeepSpeed's own ZeRO-3 linear autograd function, which its zero.Init installs as "
                              "F.linear (mem_efficient_linear) and code builds by name; shardwise's ZeRO-3 gathers "
                              "weights for any module and never uses it itself",
    "runtime/comm/coalesced_collectives.py": "DeepSpeed's reduce_scatter_coalesced helper (an average before one "
                                             "reduce-scatter) for code that calls it by name; shardwise's own "
                                             "reductions (zero/buckets) never use it",
    "inference/quantization/utils.py": "DeepSpeed's ZeRO-Inference weight quantization that its zero.Init applies "
                                       "(asymmetric groups kept as codes, scales and minimums in one tensor of the "
                                       "weight's dtype: DeepSpeed's layout, read back by its DeQuantizer and its "
                                       "F.linear / F.embedding wrappers); shardwise has no build-time weight "
                                       "quantization and never uses it",
    "moe/ep_tp_dispatch.py": "DeepSpeed's AutoEP+AutoTP folded-dispatch helpers (splitting routed assignments "
                             "across tensor lanes, summing them back per token, a routing digest) for code that "
                             "calls them by name; shardwise's AutoEP does not fold experts onto tensor lanes and "
                             "never uses them",
}


_NOT_TENSORS = frozenset({"re", "os", "math", "string", "operator"})  # modules whose functions share a name


def _py_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


_IMPORT_CALLS = ("importlib.import_module", "import_module", "__import__")


def _imports_deepspeed(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "deepspeed" for a in node.names):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "deepspeed":
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and _call_name(node) in _IMPORT_CALLS and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str) \
                and node.args[0].value.split(".")[0] == "deepspeed":
            lines.append(node.lineno)
    return lines


def _call_name(node: ast.Call) -> str:
    parts = []
    f = node.func
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    if isinstance(f, ast.Name):
        parts.append(f.id)
    return ".".join(reversed(parts))


def _shardwise_names(tree: ast.AST) -> set[str]:
    """Local names bound to shardwise modules or objects by an import."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "shardwise":
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "shardwise":
            names.update(a.asname or a.name for a in node.names if a.name != "*")
    return names


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def attribute_writes(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` for every attribute set or deleted on a name imported from shardwise."""
    imported = _shardwise_names(tree)
    found = []
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, (ast.Store, ast.Del)) \
                        and _root_name(sub.value) in imported:
                    found.append((node.lineno, f"{ast.unparse(sub)} (assignment)"))
        if isinstance(node, ast.Call) and _call_name(node) in ("setattr", "delattr", "builtins.setattr") \
                and node.args and _root_name(node.args[0]) in imported:
            found.append((node.lineno, f"{_call_name(node)}({ast.unparse(node.args[0])}, ...)"))
    return found


def math_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, call)`` for every call in ``MATH``, and every import of ``torch.nn.functional``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, root = node.func.attr, _root_name(node.func.value)
            if name in TENSOR_MATH and root not in _NOT_TENSORS or name in MATH and root in _TORCH_ROOTS:
                found.append((node.lineno, ast.unparse(node.func)))
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.nn" and any(a.name == "functional"
                                                                                     for a in node.names):
            found.append((node.lineno, "from torch.nn import functional"))
        elif isinstance(node, ast.Import) and any(a.name == "torch.nn.functional" for a in node.names):
            found.append((node.lineno, "import torch.nn.functional"))
    return found


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), filename=str(path))


def test_shardwise_never_imports_deepspeed():
    bad = [f"{p.relative_to(ROOT)}:{line}" for p in _py_files(SHARDWISE) for line in _imports_deepspeed(_parse(p))]
    assert not bad, "shardwise/ imports deepspeed (compat depends on shardwise, not the reverse):\n" + "\n".join(bad)


def test_compat_sets_no_attributes_on_shardwise():
    bad = [f"{p.relative_to(ROOT)}:{line}: {what}"
           for p in _py_files(COMPAT) for line, what in attribute_writes(_parse(p))]
    assert not bad, "compat writes attributes of shardwise objects (subclass instead):\n" + "\n".join(bad)


def test_compat_holds_no_numerics():
    bad = []
    for p in _py_files(COMPAT):
        rel = p.relative_to(COMPAT).as_posix()
        if rel in NUMERICS_ALLOWED:
            continue
        bad += [f"{p.relative_to(ROOT)}:{line}: {call}" for line, call in math_calls(_parse(p))]
    assert not bad, "tensor math in compat (it belongs in shardwise/; compat keeps names):\n" + "\n".join(bad)


def test_allow_list_is_current():
    """Every allowed module exists and still needs its allowance."""
    stale = [rel for rel in NUMERICS_ALLOWED if not (COMPAT / rel).is_file() or not math_calls(_parse(COMPAT / rel))]
    assert not stale, f"NUMERICS_ALLOWED names modules without tensor math: {stale}"


# -- the checks catch what they are meant to ------------------------------------------------------------------

@pytest.mark.parametrize("source,expected", [
    ("import deepspeed", [1]),
    ("import deepspeed.comm as dist", [1]),
    ("from deepspeed.runtime import engine", [1]),
    ("def f():\n    import importlib\n    return importlib.import_module('deepspeed.ops')", [3]),
    ("from . import deepspeed_format\nimport shardwise", []),
    ("x = 'import deepspeed'", []),
])
def test_deepspeed_import_check(source, expected):
    assert _imports_deepspeed(ast.parse(source)) == expected


def test_attribute_write_check():
    tree = ast.parse(
        "import shardwise.runtime.engine as eng\n"
        "from shardwise.runtime.engine import Engine\n"
        "from mine import Local\n"
        "Engine._config = 1\n"  # 4
        "eng.Engine.helper = 2\n"  # 5
        "for k, v in {}.items():\n    setattr(Engine, k, v)\n"  # 7
        "del Engine.x\n"  # 8
        "Local.y = 3\n"  # not shardwise
        "class Sub(Engine):\n    z = 4\n"  # a subclass: fine
        "def f(self):\n    self.w = 5\n")  # fine
    assert sorted(line for line, _ in attribute_writes(tree)) == [4, 5, 7, 8]


def test_math_check():
    tree = ast.parse("import torch\nimport torch.nn.functional as F\nfrom torch.nn import functional\n"
                     "y = F.linear(x, w)\nz = x.norm(2)\nt = torch.cat([a, b]).clone().to('cpu')\n"
                     "u = re.sub('a', 'b', s)\nseen.add(k)\nv = torch.add(a, b)\nw = a.t().matmul(b)\n")
    assert [line for line, _ in math_calls(tree)] == [2, 3, 4, 5, 9, 10]
