"""``deepspeed.runtime.config_utils``: DeepSpeed's pydantic base class for config blocks, which code written
for DeepSpeed subclasses for its own configs, and the small readers of a config dict.

``DeepSpeedConfigModel`` rules, as DeepSpeed's: unknown keys are refused (``ValidationError``), fields may be
given by alias or by name, assignments are validated, a value ``"auto"`` counts as unset unless
``strict=True``, and a field declared with ``json_schema_extra={"deprecated": True, "new_param": "name",
"new_param_fn": fn, "set_new_param": True, "deprecated_msg": "..."}`` is upgraded: a warning, then the new
field (a dotted path reaches into a sub-block) gets ``fn(value)``; giving both is an ``AssertionError``.
shardwise's own config models are ``shardwise.config`` (they upgrade deprecated keys in their loader).
"""
from __future__ import annotations

import collections
import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from shardwise.utils.logging import logger

__all__ = ["DeepSpeedConfigModel", "DeepSpeedConfigObject", "get_config_default", "get_scalar_param",
           "get_list_param", "get_dict_param", "dict_raise_error_on_duplicate_keys", "pp_int"]


class DeepSpeedConfigModel(BaseModel):
    model_config = ConfigDict(validate_default=True, validate_assignment=True, use_enum_values=True,
                              populate_by_name=True, extra="forbid", arbitrary_types_allowed=True,
                              protected_namespaces=())

    def __init__(self, strict: bool = False, **data: Any) -> None:
        if not strict:  # Hugging Face writes "auto" for what it fills in later; replace_method takes it as a value
            data = {k: v for k, v in data.items() if k == "replace_method" or not (isinstance(v, str) and v == "auto")}
        super().__init__(**data)
        for name, field in type(self).model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and extra.get("deprecated") and name in self.model_fields_set:
                self._upgrade_deprecated(name, extra)

    def _upgrade_deprecated(self, name: str, extra: dict) -> None:
        new = extra.get("new_param", "")
        note = extra.get("deprecated_msg", "")
        logger.warning(f"Config parameter {name} is deprecated" + (f" use {new} instead" if new else "")
                       + (f". {note}" if note else ""))
        if not new or not extra.get("set_new_param", True):
            return
        value = extra.get("new_param_fn", lambda x: x)(getattr(self, name))
        delattr(self, name)
        *parents, leaf = new.split(".")
        owner = self
        for part in parents:
            owner = getattr(owner, part)
        assert leaf not in owner.model_fields_set, \
            f"Cannot provide deprecated parameter '{name}' and replacing parameter '{new}' together"
        setattr(owner, leaf, value)


def get_config_default(config: type[BaseModel] | BaseModel, field_name: str) -> Any:
    fields = type(config).model_fields if isinstance(config, BaseModel) else config.model_fields
    assert field_name in fields, f"'{field_name}' is not a field in {config}"
    assert not fields[field_name].is_required(), f"'{field_name}' is a required field and does not have a default value"
    return fields[field_name].get_default()


class pp_int(int):
    """An int that prints with thousands separators (or a given text), for generated documentation."""

    def __new__(cls, val, custom_print_str=None):
        obj = super().__new__(cls, val)
        obj.custom_print_str = custom_print_str
        return obj

    def __repr__(self) -> str:
        return self.custom_print_str or f"{int(self):,}"


class DeepSpeedConfigObject:
    """Prints as the JSON of its attributes."""

    def repr(self) -> dict:
        return self.__dict__

    def __repr__(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True, indent=4, default=str)


def get_scalar_param(param_dict: dict, param_name: str, param_default_value: Any) -> Any:
    return param_dict.get(param_name, param_default_value)


get_list_param = get_dict_param = get_scalar_param


def dict_raise_error_on_duplicate_keys(ordered_pairs: list[tuple[str, Any]]) -> dict:
    """``object_pairs_hook`` for ``json.load``: a key given twice is a ValueError naming it."""
    counts = collections.Counter(k for k, _ in ordered_pairs)
    repeated = [k for k, n in counts.items() if n > 1]
    if repeated:
        raise ValueError(f"Duplicate keys in DeepSpeed config: {repeated}")
    return dict(ordered_pairs)
