"""A loaded chat model that turns a conversation into an answer, whole or streamed.

Prompts are rendered by the same :class:`shardwise.data.ChatEncoder` that fine-tuning used,
so the server sees exactly the layout the model was trained on.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from shardwise.data.chat import ChatEncoder, Message

__all__ = ["ChatModel", "Answer", "GenerationLimits", "MIN_TEMPERATURE", "TokenLogprob"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class TokenLogprob:
    """One token with its log-probability under the model (the log-softmax of its raw logits, before
    temperature and penalties) and the ``top`` most likely tokens at that place as ``(id, logprob)``,
    most likely first. ``logprob`` is None for the first token of a scored prompt (nothing precedes it)."""
    token: int
    logprob: float | None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Answer:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string), "length" (hit the token limit) or "cancelled"
    token_ids: list[int] = field(default_factory=list)  # every generated token, a stop string's included
    logprobs: list[TokenLogprob] | None = None  # one per generated token when the request asked for them
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


MIN_TEMPERATURE = 1e-3  # below this, sampling is greedy: logits / T would overflow for T near 0


@dataclass(frozen=True)
class GenerationLimits:
    """How one request is decoded.

    ``stop``: strings that end the answer when generated (finish "stop"; the answer stops before the
    first of them). ``presence_penalty`` / ``frequency_penalty`` (OpenAI semantics, in [-2, 2]): each
    token's logit is lowered by ``frequency_penalty`` times the number of times it was generated so
    far, plus ``presence_penalty`` if it was generated at all. ``seed``: sampling draws from a
    generator of its own seeded with it, so a request gets the same samples whatever it is batched with.
    """
    max_new_tokens: int
    temperature: float
    top_p: float
    stop: Sequence[str] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            return acc.current_accelerator()
        return torch.device("cpu")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device: {device!r} is not a device name (cpu, cuda, cuda:1, ... or auto)") from None


class ChatModel:
    def __init__(self, model, tokenizer, *, device: torch.device, template: str = "auto", name: str = "model"):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.name = name
        self.encoder = ChatEncoder(tokenizer, template=template)
        self.context_length = int(getattr(model.config, "max_position_embeddings", 0) or 0) or None
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    @classmethod
    def load(cls, path: str, *, device: str = "cpu", dtype: str = "float32", trust_remote_code: bool = False,
             template: str = "auto") -> "ChatModel":
        """Load a model folder (full model, or a LoRA adapter folder with adapter_config.json)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not os.path.isdir(path):
            raise ValueError(f"--model: {path} is not a folder")
        dev = _resolve_device(device)
        kw = {"trust_remote_code": trust_remote_code, "dtype": _DTYPES.get(dtype, "auto")}
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            try:
                from peft import AutoPeftModelForCausalLM
            except ImportError:
                raise ValueError(f"--model: {path} holds a LoRA adapter; loading it needs peft "
                                 "(pip install 'shardwise[lora]')") from None
            model = AutoPeftModelForCausalLM.from_pretrained(path, **kw).merge_and_unload()
        elif os.path.isfile(os.path.join(path, "config.json")):
            model = AutoModelForCausalLM.from_pretrained(path, **kw)
        else:
            raise ValueError(f"--model: {path} has neither config.json nor adapter_config.json")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        model.to(dev).eval()
        return cls(model, tokenizer, device=dev, template=template, name=os.path.basename(os.path.abspath(path)))

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """Token ids of the rendered conversation; ValueError if the messages cannot be rendered."""
        return self.encoder.source_ids(messages)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], limits: GenerationLimits, *,
                 on_text: Callable[[str], None] | None = None, cancel: threading.Event | None = None) -> Answer:
        """Generate an answer; ``on_text`` receives the text as it grows, in pieces whose
        concatenation is the final answer. Runs in the calling thread (keep it off an event loop)."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)
        kwargs = dict(max_new_tokens=limits.max_new_tokens, eos_token_id=self.tokenizer.eos_token_id,
                      pad_token_id=self.pad_id, attention_mask=torch.ones_like(ids))
        if limits.temperature >= MIN_TEMPERATURE:
            kwargs.update(do_sample=True, temperature=limits.temperature, top_p=limits.top_p, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        streamer = _TextDeltas(self.tokenizer, on_text) if on_text is not None else None

        class _Cancelled(StoppingCriteria):
            def __call__(self, input_ids, scores, **kw):
                return torch.full((input_ids.shape[0],), cancel is not None and cancel.is_set(), dtype=torch.bool)

        out = self.model.generate(ids, streamer=streamer, stopping_criteria=StoppingCriteriaList([_Cancelled()]),
                                  **kwargs)
        new = out[0, ids.shape[1]:].tolist()
        stopped = bool(new) and new[-1] == self.tokenizer.eos_token_id
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        if streamer is not None:
            streamer.finish(text)
        reason = "stop" if stopped else "cancelled" if cancel is not None and cancel.is_set() else "length"
        return Answer(text=text, prompt_tokens=len(prompt_ids), completion_tokens=len(new), finish_reason=reason,
                      token_ids=new)


class _TextDeltas:
    """A ``generate`` streamer that reports newly decoded text, never splitting a character.

    Byte-level tokenizers may end a step in the middle of a multi-byte character, which decodes
    to U+FFFD; such a tail is held back until the next token completes it.
    """

    def __init__(self, tokenizer, on_text: Callable[[str], None]) -> None:
        self.tokenizer = tokenizer
        self.on_text = on_text
        self.ids: list[int] = []
        self.sent = ""
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first passes the prompt itself
            self._prompt_seen = True
            return
        self.ids.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return
        if len(text) > len(self.sent):
            self.on_text(text[len(self.sent):])
            self.sent = text

    def end(self) -> None:
        pass

    def finish(self, final: str) -> None:
        """Send what is still missing of ``final`` (the authoritative decode of the whole answer)."""
        if final.startswith(self.sent) and len(final) > len(self.sent):
            self.on_text(final[len(self.sent):])
            self.sent = final
