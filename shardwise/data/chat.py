"""Render a conversation as text and tokenise it for causal-LM fine-tuning.

A conversation is a list of ``{"role": ..., "content": ...}`` messages ending with the user's
turn. It is rendered with the tokenizer's chat template when the tokenizer has one, otherwise
with the round template of ChatGLM-style models::

    [Round 1]\\n\\n问：{query 1}\\n\\n答：{answer 1}\\n\\n[Round 2]\\n\\n问：{query 2}\\n\\n答：

A training sample is ``source + target``: the source is the rendered conversation up to the
point where the assistant starts answering; the target is the response followed by the EOS
token. Labels are ``-100`` on the source, so only the response (and EOS) is learned.

Truncation keeps the response: the target is cut to ``max_target_length`` tokens (the EOS is
kept as the last one); a source longer than ``max_source_length`` first loses its oldest history
rounds, then, if the current query alone is still too long, its oldest tokens (leading special
tokens such as BOS are kept).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Sequence

IGNORE_INDEX = -100
ROUND_TEMPLATE = "round"
CHAT_TEMPLATE = "chat"

Message = dict[str, str]

__all__ = ["IGNORE_INDEX", "ChatEncoder", "history_to_messages", "messages_to_pairs", "render_rounds",
           "tokenizer_fingerprint"]


def history_to_messages(prompt: str, history: Sequence[Sequence[str]] = ()) -> list[Message]:
    """``prompt`` plus ``[[query, answer], ...]`` as chat messages (an empty query is kept)."""
    messages: list[Message] = []
    for query, answer in history:
        messages.append({"role": "user", "content": query})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": prompt})
    return messages


def messages_to_pairs(messages: Sequence[Message]) -> tuple[str, list[tuple[str, str]], str]:
    """Split messages into ``(system, [(query, answer), ...], last query)`` for the round template.

    An assistant message with no user message before it pairs with an empty query (the agent
    spoke first). Raises ValueError when the messages do not alternate or do not end with the user.
    """
    system_parts: list[str] = []
    pairs: list[tuple[str, str]] = []
    pending: str | None = None
    for i, msg in enumerate(messages):
        role, content = msg["role"], msg["content"]
        if role == "system":
            if pairs or pending is not None:
                raise ValueError(f"messages[{i}]: a system message must come before the conversation")
            system_parts.append(content)
        elif role == "user":
            if pending is not None:
                raise ValueError(f"messages[{i}]: two user messages in a row (the round template needs "
                                 "user and assistant turns to alternate)")
            pending = content
        elif role == "assistant":
            pairs.append((pending or "", content))
            pending = None
        else:
            raise ValueError(f"messages[{i}]: unknown role {role!r} (expected system, user or assistant)")
    if pending is None:
        raise ValueError("the conversation must end with a user message")
    return "\n".join(system_parts), pairs, pending


def render_rounds(messages: Sequence[Message]) -> str:
    """The round template (see module docstring); a system message goes first, then a blank line."""
    system, pairs, query = messages_to_pairs(messages)
    parts = [f"{system}\n\n"] if system else []
    for i, (q, a) in enumerate(pairs):
        parts.append(f"[Round {i + 1}]\n\n问：{q}\n\n答：{a}\n\n")
    parts.append(f"[Round {len(pairs) + 1}]\n\n问：{query}\n\n答：")
    return "".join(parts)


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash that changes whenever the tokenizer would produce different ids for the same text."""
    h = hashlib.sha256()
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode())
    h.update(json.dumps({
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": sorted(str(t) for t in tokenizer.all_special_tokens),
        "eos": tokenizer.eos_token_id,
        "probe": tokenizer("a b 中", add_special_tokens=True)["input_ids"],
    }, ensure_ascii=False, sort_keys=True).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    source_length: int  # the first source_length tokens are the prompt; labels there are -100

    @property
    def labels(self) -> list[int]:
        return [IGNORE_INDEX] * self.source_length + self.input_ids[self.source_length:]


class ChatEncoder:
    """Turns conversations into token ids the same way for training, evaluation and serving."""

    def __init__(self, tokenizer, *, max_source_length: int | None = None, max_target_length: int | None = None,
                 template: str = "auto") -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token: set one in its tokenizer_config.json "
                             "(training appends it to every response so the model learns to stop)")
        for name, value in (("max_source_length", max_source_length), ("max_target_length", max_target_length)):
            if value is not None and value < 2:
                raise ValueError(f"{name} must be at least 2, got {value}")
        if template == "auto":
            template = CHAT_TEMPLATE if getattr(tokenizer, "chat_template", None) else ROUND_TEMPLATE
        if template not in (CHAT_TEMPLATE, ROUND_TEMPLATE):
            raise ValueError(f"template must be 'auto', 'chat' or 'round', got {template!r}")
        if template == CHAT_TEMPLATE and not getattr(tokenizer, "chat_template", None):
            raise ValueError("template 'chat' asked for, but the tokenizer has no chat_template")
        self.tokenizer = tokenizer
        self.template = template
        self.max_source_length = max_source_length
        self.max_target_length = max_target_length
        self.eos_id = int(tokenizer.eos_token_id)
        self._special = set(int(i) for i in tokenizer.all_special_ids)

    def describe(self) -> dict[str, Any]:
        """What the token layout depends on besides the data (part of the cache key)."""
        return {"template": self.template, "max_source_length": self.max_source_length,
                "max_target_length": self.max_target_length,
                "tokenizer": tokenizer_fingerprint(self.tokenizer)}

    # -- rendering ---------------------------------------------------------------------------
    def render_source(self, messages: Sequence[Message]) -> str:
        """The prompt text the model continues from (ends where the assistant's answer starts)."""
        if self.template == ROUND_TEMPLATE:
            return render_rounds(messages)
        if not messages or messages[-1]["role"] != "user":
            raise ValueError("the conversation must end with a user message")
        return self.tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)

    def _target_text(self, messages: Sequence[Message], source: str, response: str) -> str:
        if self.template == ROUND_TEMPLATE:
            return response
        full = self.tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": response}], tokenize=False)
        # The template's own end-of-turn markup is part of what the model must learn to emit.
        return full[len(source):].rstrip() if full.startswith(source) else response

    # -- tokenising --------------------------------------------------------------------------
    def source_ids(self, messages: Sequence[Message]) -> list[int]:
        """Prompt ids for generation (no truncation: the server rejects prompts that are too long)."""
        return self._encode(self.render_source(messages), special=True)

    def encode(self, messages: Sequence[Message], response: str) -> Encoded:
        return self.encode_batch([(messages, response)])[0]

    def encode_batch(self, samples: Sequence[tuple[Sequence[Message], str]]) -> list[Encoded]:
        """Tokenise many samples at once (fast tokenizers work through a batch in parallel)."""
        sources = [self.render_source(m) for m, _ in samples]
        targets = [self._target_text(m, s, r) for (m, r), s in zip(samples, sources)]
        source_ids = self._encode_many(sources, special=True)
        target_ids = self._encode_many(targets, special=False)
        out = []
        for (messages, _), src, tgt in zip(samples, source_ids, target_ids):
            tgt = self._fit_target(tgt)
            src = self._fit_source(messages, src)
            out.append(Encoded(input_ids=src + tgt, source_length=len(src)))
        return out

    def _encode(self, text: str, *, special: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _encode_many(self, texts: list[str], *, special: bool) -> list[list[int]]:
        if not texts:
            return []
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=special)["input_ids"]]

    def _fit_target(self, ids: list[int]) -> list[int]:
        if not ids or ids[-1] != self.eos_id:
            ids = ids + [self.eos_id]
        limit = self.max_target_length
        if limit is not None and len(ids) > limit:
            ids = ids[: limit - 1] + [self.eos_id]
        return ids

    def _fit_source(self, messages: Sequence[Message], ids: list[int]) -> list[int]:
        limit = self.max_source_length
        if limit is None or len(ids) <= limit:
            return ids
        # Drop whole history rounds, oldest first, while there are any.
        msgs: list[Message] | None = list(messages)
        while len(ids) > limit:
            msgs = _drop_oldest_round(msgs)
            if msgs is None:
                break
            ids = self._encode(self.render_source(msgs), special=True)
        if len(ids) <= limit:
            return ids
        # The current query alone is too long: keep the leading special tokens and the tail.
        head = 0
        while head < len(ids) and ids[head] in self._special and head < limit // 2:
            head += 1
        return ids[:head] + ids[len(ids) - (limit - head):]


def _drop_oldest_round(messages: list[Message]) -> list[Message] | None:
    """``messages`` without the oldest (user, assistant) round; system messages stay. None if no history."""
    start = 0
    while start < len(messages) and messages[start]["role"] == "system":
        start += 1
    for i in range(start, len(messages) - 1):
        if messages[i]["role"] == "assistant":
            return messages[:start] + messages[i + 1:]
    return None
