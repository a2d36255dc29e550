"""Reading a config: JSON file or dict -> pre-pass (unknown keys, aliases, "auto") -> ShardwiseConfig."""

from __future__ import annotations

import difflib
import json
import logging
import os
import sys
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Union

from pydantic import BaseModel, ValidationError

from .errors import ConfigError, describe_value, validation_problems
from .model import ShardwiseConfig

__all__ = ["load_config", "normalise", "Report"]

logger = logging.getLogger("shardwise")

_TRIAD = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
_MISSING = object()


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _caller_stacklevel() -> int:
    """Stack level of the first frame outside this package, so a warning points at the user's call."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    return level


class Report:
    """What the pre-pass found: problems (errors), keys given as "auto"; warnings go out at once."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.auto_paths: list[str] = []

    def problem(self, text: str) -> None:
        self.problems.append(text)

    def warn(self, text: str) -> None:
        warnings.warn(text, FutureWarning, stacklevel=_caller_stacklevel())

    def rename(self, data: dict[str, Any], old: str, new: str, path: str) -> None:
        """Move deprecated key ``old`` to ``new`` inside ``data`` (one warning naming the replacement)."""
        if old not in data:
            return
        if new in data:
            self.problem(f"{_join(path, old)} and {_join(path, new)} are both given; "
                         f"'{old}' is a deprecated alias of '{new}', keep only '{new}'")
            data.pop(old)
            return
        self.warn(f"{_join(path, old)} is deprecated; use {_join(path, new)} instead")
        data[new] = data.pop(old)


def _members(annotation: Any) -> tuple[Any, ...]:
    """The alternatives of a field annotation (X | None -> (X, None)), Annotated stripped."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (Union, types.UnionType):
        return tuple(a for arg in typing.get_args(annotation) for a in _members(arg))
    return (annotation,)


def _submodel(annotation: Any) -> type[BaseModel] | None:
    for member in _members(annotation):
        if isinstance(member, type) and issubclass(member, BaseModel):
            return member
    return None


def _is_free_dict(annotation: Any) -> bool:
    return any(m is dict or typing.get_origin(m) is dict for m in _members(annotation))


def _unknown_key_message(model: type[BaseModel], key: str, where: str) -> str:
    hint = model.unknown_key_hint(key)  # type: ignore[attr-defined]
    if hint:
        return f"{where}: {hint}"
    valid = list(model.model_fields)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return f"{where}: unknown key; did you mean '{close[0]}'?"
    homes = [name for name, field in model.model_fields.items()
             if (sub := _submodel(field.annotation)) is not None and key in sub.model_fields]
    if homes:
        return f"{where}: unknown key here; it belongs inside '{homes[0]}' ({_join(homes[0], key)})"
    listing = f" (valid keys: {', '.join(valid)})" if len(valid) <= 12 else ""
    return f"{where}: unknown key{listing}"


def normalise(data: Any, model: type[BaseModel], path: str, report: Report) -> Any:
    """Return a cleaned copy of ``data`` for ``model``: aliases upgraded, "auto" and unknown keys removed
    (unknown keys are recorded as problems). Non-dict input is returned unchanged for pydantic to reject."""
    if not isinstance(data, dict):
        return data
    data = model.upgrade(dict(data), path, report)  # type: ignore[attr-defined]
    allow_extra = model.model_config.get("extra") == "allow"
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key)
        where = _join(path, key)
        field = model.model_fields.get(key)
        if field is None and not allow_extra:
            report.problem(_unknown_key_message(model, key, where))
            continue
        if isinstance(value, str) and value == "auto":
            report.auto_paths.append(where)
            continue
        if field is not None:
            sub = _submodel(field.annotation)
            if sub is not None:
                value = normalise(value, sub, where, report)
            elif _is_free_dict(field.annotation) and isinstance(value, dict):
                value = _drop_auto(value, where, report)
        out[key] = value
    return out


def _drop_auto(block: dict[str, Any], path: str, report: Report) -> dict[str, Any]:
    kept = {}
    for key, value in block.items():
        if isinstance(value, str) and value == "auto":
            report.auto_paths.append(_join(path, str(key)))
        else:
            kept[key] = value
    return kept


def _lookup(cfg: ShardwiseConfig, path: str) -> Any:
    obj: Any = cfg
    for part in path.split("."):
        if isinstance(obj, BaseModel):
            obj = getattr(obj, part, _MISSING)
        elif isinstance(obj, dict):
            obj = obj.get(part, _MISSING)
        else:
            return _MISSING
    return obj


def _log_auto(cfg: ShardwiseConfig, paths: list[str]) -> None:
    for path in paths:
        value = _lookup(cfg, path)
        if path in _TRIAD:
            chosen = "unset; inferred from the other batch sizes by resolve_batch_sizes()"
        elif path.startswith(("optimizer.params.", "scheduler.params.")):
            chosen = "unset; the " + path.split(".")[0] + "'s own default applies"
        elif value is _MISSING or value is None:
            chosen = "unset"
        elif path == "zero_optimization.overlap_comm":
            chosen = f"{describe_value(value)} (derived from zero_optimization.stage)"
        else:
            chosen = f"{describe_value(value)} (default)"
        logger.info("config %s: \"auto\" -> %s", path, chosen)


def _names_nested_key(parts: list[str]) -> bool:
    """Whether ``a.b.c`` (split) names a key inside a config block (aliases and deprecated names count)."""
    model: type[BaseModel] | None = ShardwiseConfig
    for part in parts[:-1]:
        field = model.model_fields.get(part) if model is not None else None
        model = _submodel(field.annotation) if field is not None else None
        if model is None:
            return False
    probe = Report()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        normalise({parts[-1]: None}, model, "", probe)
    return not probe.problems


def _drop_dotted_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Top-level keys written as a path (``"zero_optimization.reduce_bucket_size": 1024``) are what accelerate
    uses to fill "auto" values; TRL's ``prepare_deepspeed`` passes them straight to ``deepspeed.initialize``.
    DeepSpeed reads nested blocks only and ignores them: so does shardwise, with a warning naming them. A path
    that names no config key is an unknown key as usual."""
    ignored = [k for k in data if isinstance(k, str) and "." in k and _names_nested_key(k.split("."))]
    if ignored:
        logger.warning("config: ignoring top-level %s (a key written as a path is not read, as in DeepSpeed; "
                       "set it inside its block)", ", ".join(ignored))
    return {k: v for k, v in data.items() if k not in ignored}


def _from_dict(data: dict[str, Any], source: str | None) -> ShardwiseConfig:
    report = Report()
    cleaned = normalise(_drop_dotted_keys(data), ShardwiseConfig, "", report)
    problems = list(report.problems)
    cfg = None
    try:
        cfg = ShardwiseConfig.model_validate(cleaned)
    except ValidationError as exc:
        problems += validation_problems(exc)
    if problems:
        raise ConfigError(problems, source=source)
    assert cfg is not None
    _log_auto(cfg, report.auto_paths)
    return cfg


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"duplicate key '{key}' (JSON objects must not repeat a key)")
        out[key] = value
    return out


def read_config_file(path: Path) -> Any:
    """The data of a config file (JSON, or hjson as DeepSpeed reads it), duplicate keys refused."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a directory, not a JSON file: {path}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file is not UTF-8 text: {path} ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        json_error = exc
    except ConfigError as exc:
        raise ConfigError(exc.problems, source=str(path)) from None
    return _read_hjson(path, text, json_error)


def _read_hjson(path: Path, text: str, json_error: json.JSONDecodeError) -> Any:
    """DeepSpeed reads its config files as hjson (JSON plus comments, unquoted keys and strings, optional
    commas); so does shardwise when the ``hjson`` package is installed (the compat package requires it)."""
    where = f"{path}:{json_error.lineno}:{json_error.colno}"
    try:
        import hjson
    except ImportError:
        raise ConfigError(f"{where}: invalid JSON: {json_error.msg} (an hjson config, as DeepSpeed reads, "
                          "needs the hjson package: pip install hjson)") from None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except ConfigError as exc:
        raise ConfigError(exc.problems, source=str(path)) from None
    except hjson.HjsonDecodeError as exc:
        raise ConfigError(f"{where}: invalid JSON: {json_error.msg}; as hjson: {exc.msg} at line {exc.lineno} "
                          f"column {exc.colno}") from None


def load_config(config: "str | os.PathLike[str] | dict[str, Any] | ShardwiseConfig") -> ShardwiseConfig:
    """Build a validated :class:`ShardwiseConfig` from a JSON file path, a dict or an existing config.

    Every problem found is reported at once in one :class:`ConfigError`.
    """
    if isinstance(config, ShardwiseConfig):
        return config
    if isinstance(config, dict):
        return _from_dict(config, source=None)
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        data = read_config_file(path)
        if not isinstance(data, dict):
            raise ConfigError(f"the top level must be a JSON object {{...}}, got {type(data).__name__}",
                              source=str(path))
        return _from_dict(data, source=str(path))
    raise ConfigError(f"load_config(config=...): expected a JSON file path, a dict or a ShardwiseConfig, "
                      f"got {type(config).__name__}")
