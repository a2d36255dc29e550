"""Request bodies of the chat server, validated strictly, and readable messages for bad ones.

Strings must be JSON strings of valid Unicode (a lone surrogate such as ``"\\ud800"`` is refused)
and numbers JSON numbers (``"0.7"`` is not a temperature); unknown fields are ignored, as
OpenAI-style clients send extras. A temperature above 0 but below ``MIN_TEMPERATURE`` (1e-3)
decodes greedily, as 0 does: dividing logits by such a number overflows.

The OpenAI bodies take OpenAI's ranges: ``n`` 1..128, ``stop`` up to 4 strings,
``presence_penalty`` / ``frequency_penalty`` in [-2, 2], completions ``logprobs`` 0..5 and chat
``top_logprobs`` 0..20.
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator,
                      model_validator)

__all__ = ["ChatRequest", "CompletionRequest", "DetokenizeRequest", "OpenAIMessage", "OpenAIRequest", "TokenizeRequest",
           "describe_errors"]


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


MAX_N = 128
MAX_STOP = 4


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _OpenAISampling(_Sampling):
    model: Optional[Text] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    stop: Optional[Union[Text, list[Text]]] = None
    seed: Optional[StrictInt] = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)
    presence_penalty: Optional[Any] = None
    frequency_penalty: Optional[Any] = None
    logit_bias: Optional[dict[str, Any]] = None

    @field_validator("presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _penalty(cls, v):
        return _number(v, low=-2.0, high=2.0)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        return [s for s in stops if s]

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server")
        return None

    @property
    def stop_list(self) -> list[str]:
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class OpenAIRequest(_OpenAISampling):
    """``POST /v1/chat/completions``."""

    messages: list[OpenAIMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)  # newer clients send this name
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


TokenIds = list[StrictInt]


class CompletionRequest(_OpenAISampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either (one choice set each)."""

    prompt: Union[Text, TokenIds, list[Text], list[TokenIds]]
    max_tokens: StrictInt = Field(16, ge=0)  # OpenAI's default; 0 only with echo (scoring the prompt)
    logprobs: Optional[StrictInt] = Field(None, ge=0, le=5)
    echo: StrictBool = False
    best_of: Optional[StrictInt] = None
    suffix: Optional[Text] = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.echo and self.stream:
            raise ValueError("echo cannot be combined with stream (send echo without stream to score a prompt)")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 generates nothing; it is allowed only with echo (scoring the prompt)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of {self.best_of} is not supported (only best_of equal to n)")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported by this server")
        return self

    @property
    def prompts(self) -> list:
        """The prompt as a list of prompts, each text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]
        return list(p)


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` text, or chat ``messages`` rendered as for generation."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[list[OpenAIMessage]] = None
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: Optional[Text] = None
    tokens: TokenIds


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
