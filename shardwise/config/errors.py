"""ConfigError and the translation of pydantic errors into one readable message."""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

from pydantic import ValidationError

__all__ = ["ConfigError", "format_path", "describe_value", "validation_problems"]


class ConfigError(ValueError):
    """A problem with a shardwise/DeepSpeed config.

    ``problems`` holds one line per problem, each starting with the key path
    it is about (``zero_optimization.reduce_bucket_size: ...``).
    """

    def __init__(self, problems: str | Sequence[str], *, source: str | None = None) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        super().__init__(_join(self.problems, source))


def _join(problems: list[str], source: str | None) -> str:
    if len(problems) == 1:
        return f"{source}: {problems[0]}" if source else problems[0]
    where = f" in {source}" if source else ""
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"{len(problems)} problems{where}:\n{lines}"


def format_path(loc: Iterable[Any]) -> str:
    """('zero_optimization', 'offload_param', 'device') -> 'zero_optimization.offload_param.device'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def describe_value(value: Any, *, limit: int = 60) -> str:
    """Render a user value the way it was most likely written (JSON spelling for true/false/null)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# pydantic error type -> what we expected, in words
_EXPECTED = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "dict_type": "an object (a JSON {...} block)",
    "model_type": "an object (a JSON {...} block)",
    "model_attributes_type": "an object (a JSON {...} block)",
    "list_type": "a list",
}

_BOUNDS = {
    "greater_than": ("gt", "a value > {}"),
    "greater_than_equal": ("ge", "a value >= {}"),
    "less_than": ("lt", "a value < {}"),
    "less_than_equal": ("le", "a value <= {}"),
}


def _one_problem(err: dict[str, Any]) -> str:
    path = format_path(err["loc"])
    kind = err["type"]
    got = describe_value(err.get("input"))
    ctx = err.get("ctx") or {}
    if kind.startswith("shardwise_"):  # our own PydanticCustomError: message is already complete
        text = err["msg"]
    elif kind in _EXPECTED:
        text = f"expected {_EXPECTED[kind]}, got {got}"
    elif kind in _BOUNDS:
        key, template = _BOUNDS[kind]
        text = f"expected {template.format(ctx.get(key))}, got {got}"
    elif kind == "literal_error":
        text = f"expected {ctx.get('expected')}, got {got}"
    elif kind == "missing":
        text = "required key is missing"
    elif kind == "extra_forbidden":
        text = "unknown key"
    elif kind in ("string_too_short", "too_short"):
        text = f"must not be empty, got {got}"
    else:
        msg = str(err["msg"]).removeprefix("Value error, ")
        text = msg.replace("Input should be", "expected", 1) + (f", got {got}" if "input" in err else "")
    return f"{path}: {text}" if path else text


def validation_problems(exc: ValidationError) -> list[str]:
    """One readable line per pydantic error, each naming the full key path."""
    return [_one_problem(err) for err in exc.errors(include_url=False)]
