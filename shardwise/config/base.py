"""Shared building blocks of the config models: the strict base class and value types."""

from __future__ import annotations

import functools
from types import UnionType
from typing import TYPE_CHECKING, Annotated, Any, Callable, ClassVar, Literal, Union, get_args, get_origin

from pydantic import AllowInfNan, BaseModel, BeforeValidator, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from .errors import describe_value

if TYPE_CHECKING:  # pragma: no cover
    from .loader import Report

__all__ = ["ConfigModel", "Int", "Float", "DType", "OptDType", "case_insensitive", "not_implemented", "is_default"]


class ConfigModel(BaseModel):
    """Base of every config block: unknown keys are rejected, and values must have their JSON type.

    The one type rule (strict mode): booleans are JSON ``true``/``false``, numbers are JSON
    numbers, strings are strings. ``"32"``, ``"yes"``, ``2`` for a boolean or ``"1.5"`` for a
    number are errors naming the key, never quietly converted. The exceptions: the string
    ``"auto"`` (Hugging Face templates), which the loader's pre-pass treats as "not set" before
    validation; the integers ``0`` and ``1`` for a boolean (what pydantic's lax mode, and so
    DeepSpeed, takes: configs written ``"zero_allow_untested_optimizer": 1`` exist); integral
    floats (``5e8``) for an integer, as in DeepSpeed.

    Three class-level hooks are used by the loader's pre-pass (``loader.normalise``):
    ``renamed`` maps a deprecated key to its replacement, ``upgrade`` may
    rewrite the raw dict of this block before validation (for aliases that
    need more than a rename), and ``refused`` names the DeepSpeed keys of this
    block that shardwise does not implement, each with its reason: a value that
    changes nothing (DeepSpeed's default) passes, any other is an error naming the
    key and the reason, never silently accepted.
    """

    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())

    @model_validator(mode="before")
    @classmethod
    def _booleans_from_0_and_1(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        flags = _boolean_fields(cls)
        if not any(type(data.get(k)) is int and data[k] in (0, 1) for k in flags):
            return data
        return {k: bool(v) if k in flags and type(v) is int and v in (0, 1) else v for k, v in data.items()}

    renamed: ClassVar[dict[str, str]] = {}
    # DeepSpeed key -> (does this value change nothing?, why it is refused otherwise)
    refused: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}

    @classmethod
    def upgrade(cls, data: dict[str, Any], path: str, report: "Report") -> dict[str, Any]:
        for old, new in cls.renamed.items():
            report.rename(data, old, new, path)
        for key, (harmless, why) in cls.refused.items():
            if key not in data:
                continue
            value = data[key]
            if (isinstance(value, str) and value == "auto") or harmless(value):
                if key not in cls.model_fields:
                    data.pop(key)  # DeepSpeed's default: nothing to do
                continue
            data.pop(key)
            where = f"{path}.{key}" if path else key
            shown = f" = {describe_value(value)}" if not isinstance(value, (dict, list)) else ""
            report.problem(f"{where}{shown}: {why}")
        return data

    @classmethod
    def unknown_key_hint(cls, key: str) -> str | None:
        """A specific explanation for a key that does not belong here (or None)."""
        return None


def not_implemented(what: str, instead: str = "remove the key") -> str:
    """The reason text of a ``refused`` entry for a DeepSpeed feature shardwise lacks."""
    return f"{what} is not implemented in shardwise; {instead}"


def is_default(default: Any) -> Callable[[Any], bool]:
    """A ``refused`` predicate: the value is DeepSpeed's default (for a switch also ``0``/``1``, as the config
    takes them for booleans; for a number any JSON number equal to it, but never ``true``/``false``)."""
    def check(value: Any) -> bool:
        if default is None:
            return value is None
        if isinstance(default, bool):
            return type(value) in (bool, int) and value == default
        return not isinstance(value, bool) and isinstance(value, (int, float)) and value == default
    return check


def _is_boolean(annotation: Any) -> bool:
    """``bool`` or ``bool | None``."""
    if annotation is bool:
        return True
    args = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else ()
    return bool(args) and set(args) == {bool, type(None)}


@functools.cache
def _boolean_fields(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for name, field in model.model_fields.items() if _is_boolean(field.annotation))


def _reject_bool(kind: str):
    def check(value: Any) -> Any:
        if isinstance(value, bool):
            got = "true" if value else "false"
            raise PydanticCustomError("shardwise_type", f"expected {kind}, got {got}")
        return value
    return check


def _integral(value: Any) -> Any:
    value = _reject_bool("an integer")(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)  # 5e8 written in JSON is an integer
    return value


def _number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        # DeepSpeed's words ("must be a number"), shown by pydantic's ValidationError as well as by ConfigError
        raise PydanticCustomError("shardwise_type", "must be a number, got {got}", {"got": describe_value(value)})
    return value


# JSON true/false are not numbers here (pydantic would quietly turn true into 1); strings are
# not numbers either (strict mode). Integers accept integral floats, so 5e8 is fine.
Int = Annotated[int, BeforeValidator(_integral)]
Float = Annotated[float, BeforeValidator(_number), AllowInfNan(False)]


_DTYPE_SPELLINGS = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bfloat16": "bf16",
}


def _normalise_dtype(value: Any) -> Any:
    if value is None:
        return None
    text = str(value).strip().lower().removeprefix("torch.")  # also takes torch.float16 itself
    if text in _DTYPE_SPELLINGS:
        return _DTYPE_SPELLINGS[text]
    raise PydanticCustomError(
        "shardwise_dtype",
        f"expected one of 'fp32', 'fp16', 'bf16' (or 'float32', 'float16', 'bfloat16'), got {value!r}",
    )


DType = Annotated[Literal["fp32", "fp16", "bf16"], BeforeValidator(_normalise_dtype)]
OptDType = Annotated[Literal["fp32", "fp16", "bf16"] | None, BeforeValidator(_normalise_dtype)]


def case_insensitive(*choices: str) -> BeforeValidator:
    """Accept any capitalisation of ``choices`` and store the canonical spelling."""
    by_lower = {c.lower(): c for c in choices}

    def pick(value: Any) -> Any:
        if isinstance(value, str):
            return by_lower.get(value.lower(), value)
        return value
    return BeforeValidator(pick)
