"""Request bodies of the chat server, validated strictly, and readable messages for bad ones.

Strings must be JSON strings of valid Unicode (a lone surrogate such as ``"\\ud800"`` is refused)
and numbers JSON numbers (``"0.7"`` is not a temperature); unknown fields are ignored, as
OpenAI-style clients send extras. A temperature above 0 but below ``MIN_TEMPERATURE`` (1e-3)
decodes greedily, as 0 does: dividing logits by such a number overflows.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

__all__ = ["ChatRequest", "OpenAIMessage", "OpenAIRequest", "describe_errors"]


def _unicode(text: str) -> str:
    """Refuse strings a UTF-8 encoder (and so the tokenizer) cannot take: lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"invalid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start} "
                         "(send UTF-8 text; a surrogate pair must be complete)") from None
    return text


Text = Annotated[StrictStr, AfterValidator(_unicode)]


def _number(value: Any, *, low: float, high: float, low_open: bool = False) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError("must be a number")
    if not math.isfinite(value):  # json.loads reads NaN and Infinity; NaN compares false with any bound
        raise ValueError(f"must be a finite number, got {value}")
    if value < low or (low_open and value == low) or value > high:
        bracket = "(" if low_open else "["
        raise ValueError(f"must be in {bracket}{low}, {high}], got {value}")
    return float(value)


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    temperature: Optional[Any] = None
    top_p: Optional[Any] = None

    @field_validator("temperature", mode="before")
    @classmethod
    def _temperature(cls, v):
        return _number(v, low=0.0, high=100.0)

    @field_validator("top_p", mode="before")
    @classmethod
    def _top_p(cls, v):
        return _number(v, low=0.0, high=1.0, low_open=True)


class ChatRequest(_Sampling):
    """``{"prompt": str, "history": [[query, answer], ...], "max_length"?, "top_p"?, "temperature"?}``"""

    prompt: Text
    history: Optional[list[tuple[Text, Text]]] = None
    max_length: Optional[StrictInt] = Field(None, ge=2)


class OpenAIMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: Text


class OpenAIRequest(_Sampling):
    model: Optional[Text] = None
    messages: list[OpenAIMessage] = Field(min_length=1)
    stream: StrictBool = False
    max_tokens: Optional[StrictInt] = Field(None, ge=1)


def _where(loc: tuple) -> str:
    parts = [str(p) for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def describe_errors(errors: list[dict]) -> str:
    """One line naming each offending field (at most five) of a pydantic validation error."""
    lines = []
    for e in errors[:5]:
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        lines.append(f"{_where(tuple(e.get('loc', ())))}: {msg}")
    return "; ".join(lines)
