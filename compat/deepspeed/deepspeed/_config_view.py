"""A DeepSpeed config class (``DeepSpeedZeroConfig(**block)``, ...) as a view of shardwise's model of the
same block: the keys go through shardwise's loader (deprecated names upgraded, unknown keys and wrong
types refused: unknown keys with ``shardwise.config.ConfigError``, wrong values with pydantic's ``ValidationError``), and attributes answer under DeepSpeed's field names."""
from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel

from shardwise.config.errors import ConfigError
from shardwise.config.loader import Report, normalise


def validate_block(model: type[BaseModel], data: dict[str, Any], where: str) -> BaseModel:
    report = Report()
    cleaned = normalise(dict(data), model, where, report)
    if report.problems:
        raise ConfigError(report.problems, source=where)
    # a wrong value raises pydantic's ValidationError, as DeepSpeed's pydantic config classes do
    return model.model_validate(cleaned)


class ConfigView:
    """Subclasses name the shardwise ``model``, the block's path, DeepSpeed's attribute names that differ
    (``names``: DeepSpeed name -> shardwise name) and sub-blocks to wrap in views (``views``)."""

    model: ClassVar[type[BaseModel]]
    where: ClassVar[str] = ""
    names: ClassVar[dict[str, str]] = {}
    views: ClassVar[dict[str, type["ConfigView"]]] = {}

    def __init__(self, **data: Any) -> None:
        # DeepSpeed's field names are accepted as keys too (they are its pydantic field names)
        data = {self.names.get(k, k): v for k, v in data.items()}
        object.__setattr__(self, "_value", validate_block(self.model, data, self.where))

    @classmethod
    def _wrap(cls, value: BaseModel) -> "ConfigView":
        view = cls.__new__(cls)
        object.__setattr__(view, "_value", value)
        return view

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._value, self.names.get(name, name))
        sub = self.views.get(name)
        return sub._wrap(value) if sub is not None and value is not None else value

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._value, self.names.get(name, name), value)

    def model_dump(self, **kwargs) -> dict[str, Any]:
        return self._value.model_dump(**kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._value!r})"
