"""Read prompt/response/history records from JSON-lines or JSON-array files.

A file is JSON lines unless its first non-blank character is ``[`` (then it is one JSON array
of objects). JSON lines can be split into byte ranges that are read independently, so many
processes can each read a part of a large file without reading the rest; a JSON array has to
be parsed whole by every reader (use JSON lines for large data sets).

Each record must be an object with a string prompt column, a string response column, and
optionally a history column: a list of ``[query, answer]`` string pairs (missing, null or
empty means no history). A record that breaks these rules raises :class:`BadRecord`, which
names the file and line (and, in a JSON array, the element's index). A record may not repeat a
key (which value would count is a guess) nor be longer than ``max_record_bytes`` (default 1 MiB):
a JSON line is read at most that far, so one huge line cannot exhaust memory.
"""
from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

from shardwise.data.chat import Message, history_to_messages

__all__ = ["BadRecord", "Columns", "MAX_RECORD_BYTES", "file_format", "line_number", "read_records"]

_CHUNK = 1 << 20
MAX_RECORD_BYTES = 1 << 20  # a chat record past 1 MiB is far beyond any context it will be cut to


class BadRecord(ValueError):
    """A record that cannot be used; ``where`` is ``file:line`` (worked out only when asked for,
    since finding a line number means counting the newlines before it)."""

    def __init__(self, where: Any, problem: str, *, skippable: bool = True) -> None:
        super().__init__(where, problem)
        self._where = where
        self.problem = problem
        self.skippable = skippable  # False: the file itself is broken, no record can be skipped around it

    @property
    def where(self) -> str:
        return str(self._where)

    def __str__(self) -> str:
        return f"{self.where}: {self.problem}"


@dataclass(frozen=True)
class Columns:
    prompt: str = "prompt"
    response: str = "response"
    history: str | None = "history"  # None: the data has no history column


def file_format(path: str) -> str:
    """``"json"`` for a JSON array, ``"jsonl"`` otherwise (looks at the first non-blank byte)."""
    with open(path, "rb") as f:
        while True:
            block = f.read(4096)
            if not block:
                return "jsonl"
            stripped = block.lstrip()
            if stripped:
                return "json" if stripped[:1] == b"[" else "jsonl"


def line_number(path: str, offset: int) -> int:
    """1-based line number of the byte at ``offset`` (counts newlines before it, reading in chunks)."""
    count, pos = 0, 0
    with open(path, "rb") as f:
        while pos < offset:
            block = f.read(min(_CHUNK, offset - pos))
            if not block:
                break
            count += block.count(b"\n")
            pos += len(block)
    return count + 1


def read_records(path: str, columns: Columns, *, part: int = 0, parts: int = 1,
                 max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[tuple[str, list[Message], str] | BadRecord]:
    """Yield ``(where, messages, response)`` for part ``part`` of ``parts`` of the file, in file order
    (``str(where)`` is ``file:line``, computed on demand).

    Parts split JSON lines by bytes (a line belongs to the part its first byte falls in) and a
    JSON array by element index; together the parts cover every record exactly once. A bad
    record is yielded as a :class:`BadRecord` instead, so the caller decides to stop or skip.
    """
    name = os.path.basename(path)
    if file_format(path) == "json":
        for where, obj in _json_array_items(path, name, part, parts, max_record_bytes):
            yield obj if isinstance(obj, BadRecord) else _parse(obj, where, columns)
        return
    for offset, raw, length in _jsonl_lines(path, part, parts, max_record_bytes):
        where = _LazyWhere(path, name, offset)
        if raw is None:
            yield BadRecord(where, _too_long(length, max_record_bytes))
            continue
        if not raw.strip():
            continue
        duplicates: list[str] = []
        try:
            obj = json.loads(raw, object_pairs_hook=_dict_noting_duplicates(duplicates))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            yield BadRecord(where, f"not valid JSON ({_short(exc)})")
            continue
        yield BadRecord(where, _duplicate(duplicates)) if duplicates else _parse(obj, where, columns)


def _too_long(length: int, limit: int) -> str:
    return (f"the record is {length} bytes, more than the limit of {limit} (--max_record_bytes); it was not "
            "read into memory")


def _duplicate(keys: list[str]) -> str:
    return (f"the key {keys[0]!r} appears twice in one object (which value counts would be a guess); keep "
            "one of them")


def _dict_noting_duplicates(found: list[str]):
    """A json ``object_pairs_hook`` that builds the dict and appends repeated keys to ``found``."""
    def hook(pairs: list[tuple[str, Any]]) -> dict:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            found.extend(k for k, _ in pairs if k in seen or seen.add(k))
        return out
    return hook


class _LazyWhere:
    """``file:line`` computed only when a message needs it (counting lines costs a file scan)."""

    def __init__(self, path: str, name: str, offset: int) -> None:
        self.path, self.name, self.offset = path, name, offset

    def __str__(self) -> str:
        return f"{self.name}:{line_number(self.path, self.offset)}"


def _jsonl_lines(path: str, part: int, parts: int, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """``(offset, line, length)`` of each line starting in this part; ``line`` is None for a line
    longer than ``limit`` bytes (its newline not counted), which is skipped without being held."""
    size = os.path.getsize(path)
    start, end = size * part // parts, size * (part + 1) // parts
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            _skip_line(f)  # finish the line that began before our range; it belongs to the previous part
        pos = f.tell()
        while pos < end:
            raw = f.readline(limit + 1)
            if not raw:
                break
            if len(raw) > limit and not raw.endswith(b"\n"):
                length = len(raw) + _skip_line(f)
                yield pos, None, length
                pos += length
                continue
            yield pos, raw, len(raw)
            pos += len(raw)


def _skip_line(f) -> int:
    """Read past the next newline in bounded pieces; the number of bytes passed."""
    passed = 0
    while True:
        piece = f.readline(_CHUNK)
        passed += len(piece)
        if not piece or piece.endswith(b"\n"):
            return passed


def _json_array_items(path: str, name: str, part: int, parts: int, limit: int) -> Iterator[tuple[str, Any]]:
    """``(where, element)`` of this part's elements, ``where`` being ``file:line (element i)``; an
    element that is too long or repeats a key comes as a :class:`BadRecord` in its place."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise BadRecord(f"{name}:{line}", f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {column}); "
                        "save the file as UTF-8", skippable=False) from None
    duplicates: list[str] = []
    decoder = json.JSONDecoder(object_pairs_hook=_dict_noting_duplicates(duplicates))
    items: list[tuple[int, Any]] = []
    pos = text.index("[") + 1
    while True:
        pos = _skip_ws(text, pos)
        if pos < len(text) and text[pos] == "]" and not items:
            break
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise BadRecord(f"{name}:{exc.lineno} (element {len(items)})",
                            f"not a valid JSON array ({exc.msg}, column {exc.colno})", skippable=False) from None
        if duplicates:
            obj = _Problem(_duplicate(duplicates))
            duplicates.clear()
        elif end - pos > limit // 4 and len(text[pos:end].encode("utf-8")) > limit:
            obj = _Problem(_too_long(len(text[pos:end].encode("utf-8")), limit).replace(
                "; it was not read into memory", " (a JSON array is read whole: use JSON lines for large data)"))
        items.append((pos, obj))
        pos = _skip_ws(text, end)
        if pos < len(text) and text[pos] == ",":
            pos += 1
            continue
        if pos < len(text) and text[pos] == "]":
            break
        line = text.count("\n", 0, pos) + 1
        raise BadRecord(f"{name}:{line} (after element {len(items) - 1})",
                        "not a valid JSON array (expected ',' or ']' after an element)", skippable=False)
    lo, hi = len(items) * part // parts, len(items) * (part + 1) // parts
    line, counted_to = 1, 0
    for index, (pos, obj) in enumerate(items[lo:hi], start=lo):
        line += text.count("\n", counted_to, pos)
        counted_to = pos
        where = f"{name}:{line} (element {index})"
        yield where, BadRecord(where, obj.text) if isinstance(obj, _Problem) else obj


class _Problem:
    """What is wrong with one array element, kept in its place until its part is read."""

    def __init__(self, text: str) -> None:
        self.text = text


def _skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _short(exc: Exception) -> str:
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at column {exc.start + 1}"
    return exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__


def _parse(obj: Any, where: Any, columns: Columns) -> tuple[str, list[Message], str] | BadRecord:
    if not isinstance(obj, dict):
        return BadRecord(where, f"expected a JSON object, got {type(obj).__name__}")
    values = {}
    for role, key in (("prompt", columns.prompt), ("response", columns.response)):
        if key not in obj:
            return BadRecord(where, f"no {key!r} key (the {role} column){_did_you_mean(key, obj)}")
        if not isinstance(obj[key], str):
            return BadRecord(where, f"{key!r} must be a string, got {type(obj[key]).__name__}")
        values[role] = obj[key]
    history = obj.get(columns.history) if columns.history else None
    problem = _history_problem(history, columns.history)
    if problem:
        return BadRecord(where, problem)
    return where, history_to_messages(values["prompt"], history or []), values["response"]


def _history_problem(history: Any, key: str | None) -> str | None:
    if history is None:
        return None
    if not isinstance(history, list):
        return f"{key!r} must be a list of [query, answer] pairs, got {type(history).__name__}"
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            return f"{key}[{i}] must be a [query, answer] pair of strings, got {json.dumps(pair, ensure_ascii=False)[:80]}"
    return None


def _did_you_mean(key: str, obj: dict) -> str:
    close = difflib.get_close_matches(key, [str(k) for k in obj], n=1)
    found = ", ".join(repr(k) for k in list(obj)[:6])
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"; the record has {found}{hint}"
