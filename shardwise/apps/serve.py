"""Serve a fine-tuned chat model over HTTP (FastAPI + uvicorn), with OpenAI's API.

    shardwise serve --model out --port 8000 [--lora_modules sql=out/sql-lora chat=out/chat-lora]
    curl -X POST http://127.0.0.1:8000 -H 'Content-Type: application/json' \\
         -d '{"prompt": "你好", "history": []}'

Endpoints: ``POST /`` (prompt/history contract); OpenAI's ``GET /v1/models`` (the base model and
each ``--lora_modules`` adapter), ``POST /v1/completions`` (text or token-id prompts, ``n``,
``stop``, ``seed``, ``logprobs``, ``echo``, penalties, streaming) and ``POST /v1/chat/completions``
(the same, with chat ``logprobs``/``top_logprobs``), a request's ``model`` picking the base or an
adapter; vLLM's ``POST /tokenize`` and ``POST /detokenize``; Prometheus ``GET /metrics``;
``GET /health`` (liveness; says "busy" when full) and ``GET /ready`` (503 when full).

Concurrent requests are generated together (``shardwise.apps.batching``: up to
``--max_batch_size`` in one decoding step, new requests joining at the next step); at most
``--max_queue`` more are prepared or wait, the rest get 503 (a request with ``n`` choices holds
``n`` places). Nothing slow runs on the event loop: reading JSON, validating and tokenising happen
in worker threads (bodies over 64 KiB in a lane of their own, so huge prompts cannot hold up small
ones), generation and scoring in the batching thread. A prompt over ``--max_prompt_chars`` gets
400 before it is tokenised; a body over ``--max_body_bytes`` gets 413 before it is parsed; with
``--api_key`` every request needs ``Authorization: Bearer <key>`` (401 otherwise); a request that
outlives ``--request_timeout`` gets 504; a client that disconnects leaves the batch. Connection
limits (header and body timeouts, ``--max_connections``) are in ``serve_http.py``. See
docs/finetune.md.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import json
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pydantic import BaseModel, ValidationError

from shardwise.apps.batching import BatchedGenerator, GenerationTimeout, RequestFailed, RequestTooLarge
from shardwise.apps.generation import ChatModel, GenerationLimits
from shardwise.apps.options import add_serve_arguments
from shardwise.apps.serve_metrics import CONTENT_TYPE_LATEST, CountRequests, ServeMetrics
from shardwise.apps.serve_schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, OpenAIRequest,
                                          TokenizeRequest, describe_errors)
from shardwise.data.chat import history_to_messages

__all__ = ["ApiError", "ServeSettings", "create_app", "main"]

API_KEY_ENV = "SHARDWISE_API_KEY"


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers


@dataclass(frozen=True)
class ServeSettings:
    max_batch_size: int = 8
    max_queue: int = 32
    max_length: int | None = None  # default prompt+answer limit; None: the model's context length
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    request_timeout: float | None = 300.0  # seconds from arrival to the last token; None: no limit
    max_body_bytes: int | None = None  # None: room for max_prompt_chars of escaped text, at most 4 MiB
    body_timeout: float | None = 30.0  # seconds to receive the whole body once the headers are in
    max_prompt_chars: int | None = None  # None: 16 characters per token of the prompt+answer limit
    api_key: str | None = None
    served_model_name: str | None = None  # the base model's name in the API; None: the model folder's name
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, adapter folder) served per request
    kv_cache: str = "paged"
    kv_cache_bytes: int | None = None  # None: the engine's default
    kv_block_size: int = 16


LARGE_BODY = 64 * 1024  # bodies above this are prepared in their own lane, one at a time
CHARS_PER_TOKEN = 16  # default --max_prompt_chars per token of context: no real tokenizer packs more
BYTES_PER_CHAR = 12  # a character written as a JSON escaped surrogate pair: "\ud83d\ude00"
BODY_SLACK = 64 * 1024  # room for roles, field names and the extra fields OpenAI clients send
MAX_BODY = 4 * 1024 * 1024


def prompt_limits(settings: ServeSettings, context_length: int | None) -> tuple[int | None, int, int]:
    """``(tokens, characters, body bytes)`` a request may have: the prompt+answer token limit, the
    characters tokenised at most, and the largest body that could hold such a prompt."""
    tokens = settings.max_length or context_length
    chars = settings.max_prompt_chars or (CHARS_PER_TOKEN * tokens if tokens else MAX_BODY)
    body = settings.max_body_bytes or min(MAX_BODY, BYTES_PER_CHAR * chars + BODY_SLACK)
    return tokens, chars, body


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 408: "timeout", 413: "invalid_request_error",
            504: "timeout"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind}, "status": status}, status_code=status,
                        headers=headers)


class _Gate:
    """Admission control: at most ``max_batch_size + max_queue`` jobs being prepared (parsed,
    tokenised), waiting or generating; the rest get 503 before any work is spent on them. A request
    takes one place while it is prepared, then one per job it submits (``n`` choices of each prompt,
    and a scoring job per prompt for ``echo`` with ``logprobs``)."""

    def __init__(self, settings: ServeSettings) -> None:
        self.limit = settings.max_batch_size + settings.max_queue
        self.active = 0
        self._lock = threading.Lock()

    def admit(self, count: int = 1) -> None:
        with self._lock:
            if self.active + count > self.limit:
                asked = "" if count == 1 else f"; this request needs {count} more places"
                raise ApiError(503, f"server busy: {self.active} requests being prepared, generating or queued "
                                    f"(--max_batch_size + --max_queue = {self.limit}{asked}); retry later",
                               {"Retry-After": "1"})
            self.active += count

    def release(self, count: int = 1) -> None:
        with self._lock:
            self.active -= count

    @property
    def full(self) -> bool:
        return self.active >= self.limit


class _ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def create_app(chat: ChatModel, settings: ServeSettings = ServeSettings()) -> FastAPI:
    app = FastAPI(title="shardwise chat server")
    gate = _Gate(settings)
    engine = BatchedGenerator(chat, max_batch_size=settings.max_batch_size,
                              adapters=dict(settings.lora_modules) or None, kv_cache=settings.kv_cache,
                              kv_cache_bytes=settings.kv_cache_bytes, kv_block_size=settings.kv_block_size)
    metrics = ServeMetrics(engine)
    app.add_middleware(CountRequests, metrics=metrics)
    # JSON, validation and tokenising run off the event loop, in two lanes: a large body (up to
    # --max_body_bytes) waits for the one large-body thread, so a few clients sending huge prompts
    # cannot hold up the small requests, which have two threads of their own.
    small_lane = ThreadPoolExecutor(2, thread_name_prefix="prepare")
    large_lane = ThreadPoolExecutor(1, thread_name_prefix="prepare-large", initializer=_lower_priority)
    max_tokens, max_chars, max_body = prompt_limits(settings, chat.context_length)
    tokenizer = chat.tokenizer
    vocab_size = int(chat.model.get_input_embeddings().num_embeddings)
    base_name = settings.served_model_name or chat.name
    adapter_dirs = dict(settings.lora_modules)
    started = int(time.time())
    app.state.chat, app.state.gate, app.state.engine, app.state.metrics = chat, gate, engine, metrics
    app.router.add_event_handler("shutdown", engine.close)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.headers)

    @app.exception_handler(_ClientGone)
    async def _gone(request: Request, exc: _ClientGone):
        return Response(status_code=499)  # nobody reads it; uvicorn drops it

    def authorise(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                                "(the server was started with --api_key)", {"WWW-Authenticate": "Bearer"})

    async def read_body(request: Request) -> bytes:
        """The raw body, refused with 413 as soon as it is known to be over --max_body_bytes, and
        with 408 when it does not all arrive within --body_timeout."""
        limit = max_body
        too_big = ApiError(413, f"the request body is larger than --max_body_bytes ({limit} bytes; by default "
                                f"{BYTES_PER_CHAR} per character of --max_prompt_chars plus {BODY_SLACK})",
                           {"Connection": "close"})
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_big
        chunks, size = [], 0

        async def receive():
            nonlocal size
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)

        try:
            await asyncio.wait_for(receive(), settings.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within --body_timeout ({settings.body_timeout:g} s; "
                                f"{size} bytes came)", {"Connection": "close"}) from None
        return b"".join(chunks)

    def check_chars(messages) -> None:
        """Refuse a prompt too long to fit before tokenising it (tokenising costs time per character)."""
        total = sum(len(m["content"]) for m in messages)
        if max_tokens and len(messages) > max_tokens:  # each message renders to one token or more
            raise ApiError(400, f"the conversation has {len(messages)} messages, more than the {max_tokens} tokens "
                                "allowed for prompt and answer: shorten the history")
        if total > max_chars:
            raise ApiError(400, f"the prompt and history are {total} characters, more than the {max_chars} this server "
                                "tokenises (--max_prompt_chars): shorten the prompt or the history")

    def prompt_ids(messages) -> list[int]:
        check_chars(messages)
        try:
            return chat.prompt_ids(messages)
        except ValueError as exc:
            raise ApiError(400, f"cannot render the conversation: {exc}") from None

    def check_ids(ids: list[int], where: str) -> None:
        bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"{where}[{bad}]: token id {ids[bad]} is outside the vocabulary (0..{vocab_size - 1})")

    def adapter_of(model: str | None) -> str | None:
        """The adapter a request's ``model`` names (None: the base model); 404 for an unknown name."""
        if model is None or model == base_name:
            return None
        if model in adapter_dirs:
            return model
        served = ", ".join(repr(n) for n in [base_name, *adapter_dirs])
        raise ApiError(404, f"model {model!r} does not exist: this server serves {served} (GET /v1/models; "
                            "adapters come from --lora_modules NAME=DIR)")

    def check_choices(count: int, what: str) -> None:
        if count > gate.limit:
            raise ApiError(400, f"{what} asks for {count} generations, more than this server runs or queues at once "
                                f"(--max_batch_size + --max_queue = {gate.limit})")

    def limits(prompt_len: int, *, max_length=None, max_tokens=None, temperature=None, top_p=None, stop=(),
               presence_penalty=None, frequency_penalty=None, seed=None):
        context = chat.context_length
        sampling = dict(temperature=settings.temperature if temperature is None else float(temperature),
                        top_p=settings.top_p if top_p is None else float(top_p), stop=tuple(stop),
                        presence_penalty=float(presence_penalty or 0.0),
                        frequency_penalty=float(frequency_penalty or 0.0), seed=seed)
        if max_tokens == 0:  # echo only: the prompt is scored, nothing generated
            if context and prompt_len > context:
                raise ApiError(400, f"the prompt is {prompt_len} tokens, more than the model's context of {context}")
            return GenerationLimits(max_new_tokens=0, **sampling)
        if max_length is not None and context and max_length > context:
            raise ApiError(400, f"max_length {max_length} is more than the model's context of {context} tokens")
        total = max_length or settings.max_length or context
        if total and prompt_len >= total:
            raise ApiError(400, f"the prompt is {prompt_len} tokens, which leaves no room for an answer within "
                                f"max_length {total}: shorten the prompt or the history")
        new = settings.max_new_tokens if total is None else min(settings.max_new_tokens, total - prompt_len)
        if max_tokens is not None:
            if context and prompt_len + max_tokens > context:
                raise ApiError(400, f"the prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                    f"model's context of {context} tokens")
            new = min(max_tokens, settings.max_new_tokens)
        return GenerationLimits(max_new_tokens=new, **sampling)

    async def prepared(request: Request, prepare, *, admit: bool = True):
        """Read the body, take a place (503 if none; ``admit``), prepare off the loop. The caller owns
        the place: :func:`launch` turns it into jobs, or it must be given back."""
        authorise(request)
        raw = await read_body(request)
        if admit:
            gate.admit()
        try:
            lane = large_lane if len(raw) > LARGE_BODY else small_lane
            return await asyncio.get_running_loop().run_in_executor(lane, prepare, raw)
        except BaseException:
            if admit:
                gate.release()
            raise

    def launch(starters: list) -> list:
        """Start the jobs of one prepared request (it holds one place): one place per job, each given
        back when all of the request's jobs have ended."""
        places = max(1, len(starters))
        try:
            if places > 1:
                gate.admit(places - 1)
        except BaseException:
            gate.release()
            raise
        jobs = []
        try:
            for start in starters:
                jobs.append(start())
        except BaseException as exc:
            for job in jobs:
                _cancel(job)
            _release_after(jobs, places)
            if isinstance(exc, RequestTooLarge):
                raise ApiError(400, str(exc)) from None
            if isinstance(exc, ValueError):
                raise ApiError(400, str(exc)) from None
            raise
        _release_after(jobs, places)
        return jobs

    def _release_after(jobs: list, places: int) -> None:
        if not jobs:
            gate.release(places)
            return
        left = [len(jobs)]
        lock = threading.Lock()

        def one_done(_future) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                gate.release(places)

        for job in jobs:
            job.future.add_done_callback(one_done)

    def generate(ids, lim, *, adapter=None, logprobs=None, seed=None, on_text=None):
        def start():
            job = engine.submit(ids, lim, on_text=on_text, timeout=settings.request_timeout, adapter=adapter,
                                logprobs=logprobs, seed=seed)
            metrics.watch(job)
            return job
        return start

    def score(ids, *, adapter=None, top=0):
        def start():
            job = engine.score(ids, adapter=adapter, top=top)
            job.future.add_done_callback(lambda f: None if f.exception() else metrics.scored(len(ids)))
            return job
        return start

    async def results_of(jobs: list, request: Request) -> list:
        """Every job's result; the jobs are cancelled (leave the batch at the next step) when the
        client disconnects or this handler is cancelled."""
        done = asyncio.gather(*[asyncio.wrap_future(job.future) for job in jobs], return_exceptions=True)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            for job in jobs:
                _cancel(job)
            raise
        finally:
            gone.cancel()
        if not done.done():
            for job in jobs:
                _cancel(job)
            raise _ClientGone()
        results = done.result()
        for value in results:
            if isinstance(value, GenerationTimeout):
                raise ApiError(504, f"{value} (--request_timeout); {value.answer.completion_tokens} tokens were "
                                    "generated")
            if isinstance(value, RequestFailed):
                raise ApiError(500, str(value))
            if isinstance(value, BaseException):
                raise value
        return results

    def status() -> dict:
        return {"status": "busy" if gate.full else "ok", "ready": not gate.full, "model": base_name,
                "adapters": list(adapter_dirs), "device": str(chat.device), "template": chat.encoder.template,
                "active_requests": gate.active, "capacity": gate.limit, "generating": engine.running,
                "waiting": engine.waiting, "decode_steps": engine.steps}

    @app.get("/health")
    async def health(request: Request):
        """Liveness: 200 while the server runs; ``status`` is "busy" when new requests would get 503."""
        authorise(request)
        return status()

    @app.get("/ready")
    async def ready(request: Request):
        """Readiness: 200 when a new request would be taken, 503 when the server is saturated."""
        authorise(request)
        body = status()
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request):
        """Prometheus text format (see ``serve_metrics.py``)."""
        authorise(request)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        authorise(request)
        card = {"object": "model", "created": started, "owned_by": "shardwise", "max_model_len": chat.context_length}
        data = [{**card, "id": base_name, "root": base_name, "parent": None}]
        data += [{**card, "id": name, "root": path, "parent": base_name} for name, path in adapter_dirs.items()]
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        def prepare(raw: bytes):
            req = _parse(raw, TokenizeRequest)
            adapter_of(req.model)
            if req.prompt is not None:
                if len(req.prompt) > max_chars:
                    raise ApiError(400, f"the prompt is {len(req.prompt)} characters, more than the {max_chars} this "
                                        "server tokenises (--max_prompt_chars)")
                ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
            else:
                ids = prompt_ids([{"role": m.role, "content": m.content} for m in req.messages])
            body = {"count": len(ids), "max_model_len": chat.context_length, "tokens": ids}
            if req.return_token_strs:
                body["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
            return body

        return await prepared(request, prepare, admit=False)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        def prepare(raw: bytes):
            req = _parse(raw, DetokenizeRequest)
            adapter_of(req.model)
            check_ids(req.tokens, "tokens")
            return {"prompt": tokenizer.decode(req.tokens)}

        return await prepared(request, prepare, admit=False)

    @app.post("/")
    async def chat_root(request: Request):
        def prepare(raw: bytes):
            req = _parse(raw, ChatRequest)
            history = [list(pair) for pair in (req.history or [])]
            ids = prompt_ids(history_to_messages(req.prompt, history))
            lim = limits(len(ids), max_length=req.max_length, temperature=req.temperature, top_p=req.top_p)
            return req, history, ids, lim

        req, history, ids, lim = await prepared(request, prepare)
        jobs = launch([generate(ids, lim)])
        [answer] = await results_of(jobs, request)
        return {"response": answer.text, "history": history + [[req.prompt, answer.text]], "status": 200,
                "time": datetime.now().strftime("%Y-%m-%d %H:%M:%S")}

    def choice_seed(req, j: int) -> int | None:
        return None if req.seed is None else (req.seed + j) % 2 ** 64

    def sampling_of(req) -> dict:
        return dict(temperature=req.temperature, top_p=req.top_p, stop=req.stop_list,
                    presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, seed=req.seed)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        def prepare(raw: bytes):
            req = _parse(raw, OpenAIRequest)
            adapter = adapter_of(req.model)
            check_choices(req.n, f"n={req.n}")
            ids = prompt_ids([{"role": m.role, "content": m.content} for m in req.messages])
            lim = limits(len(ids), max_tokens=req.max_completion_tokens or req.max_tokens, **sampling_of(req))
            return req, adapter, ids, lim

        req, adapter, ids, lim = await prepared(request, prepare)
        top = (req.top_logprobs or 0) if req.logprobs else None
        stream = _Stream() if req.stream else None
        jobs = launch([generate(ids, lim, adapter=adapter, logprobs=top, seed=choice_seed(req, j),
                                on_text=stream.on_text_for(j) if stream else None) for j in range(req.n)])
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model or base_name}
        if stream is not None:  # admitted (or refused with 503) before the 200 response starts
            return StreamingResponse(stream.chat_events(jobs, meta, len(ids), req.include_usage, token_text),
                                     media_type="text/event-stream")
        answers = await results_of(jobs, request)
        choices = [{"index": j, "message": {"role": "assistant", "content": a.text},
                    "logprobs": None if top is None else {"content": _chat_logprobs(a.logprobs, token_text)},
                    "finish_reason": a.finish_reason} for j, a in enumerate(answers)]
        return {**meta, "object": "chat.completion", "choices": choices,
                "usage": _usage([len(ids)], answers, answers[:1])}

    @app.post("/v1/completions")
    async def completions(request: Request):
        def prepare(raw: bytes):
            req = _parse(raw, CompletionRequest)
            adapter = adapter_of(req.model)
            prompts = req.prompts
            if not prompts:
                raise ApiError(400, "prompt: no prompt given (an empty list)")
            scoring = req.echo and req.logprobs is not None
            check_choices(len(prompts) * (req.n if req.max_tokens else 0) + (len(prompts) if scoring else 0),
                          f"{len(prompts)} prompt(s) with n={req.n}")
            chars = sum(len(p) for p in prompts if isinstance(p, str))
            if chars > max_chars:
                raise ApiError(400, f"the prompts are {chars} characters, more than the {max_chars} this server "
                                    "tokenises (--max_prompt_chars)")
            items = []
            for i, p in enumerate(prompts):
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                if isinstance(p, str):
                    ids = tokenizer(p, add_special_tokens=True)["input_ids"]
                else:
                    ids = list(p)
                    check_ids(ids, where)
                if not ids:
                    raise ApiError(400, f"{where}: the prompt has no tokens")
                try:
                    lim = limits(len(ids), max_tokens=req.max_tokens, **sampling_of(req))
                except ApiError as exc:
                    raise ApiError(exc.status, f"{where}: {exc.message}") from None
                text = p if isinstance(p, str) else (tokenizer.decode(ids) if req.echo else "")
                items.append((ids, text, lim))
            return req, adapter, items

        req, adapter, items = await prepared(request, prepare)
        scoring = req.echo and req.logprobs is not None
        n_gen = req.n if req.max_tokens else 0
        stream = _Stream() if req.stream else None
        starters = []
        for i, (ids, _, lim) in enumerate(items):
            if scoring:
                starters.append(score(ids, adapter=adapter, top=req.logprobs))
            for j in range(n_gen):
                index = i * req.n + j
                starters.append(generate(ids, lim, adapter=adapter, logprobs=req.logprobs, seed=choice_seed(req, j),
                                         on_text=stream.on_text_for(index) if stream else None))
        jobs = launch(starters)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": req.model or base_name}
        if stream is not None:
            return StreamingResponse(stream.completion_events(jobs, meta, sum(len(ids) for ids, _, _ in items),
                                                              req.include_usage, token_text),
                                     media_type="text/event-stream")
        results = await results_of(jobs, request)
        per_prompt = (1 if scoring else 0) + n_gen
        choices, answers, firsts = [], [], []
        for i, (ids, text, _) in enumerate(items):
            mine = results[i * per_prompt:(i + 1) * per_prompt]
            scored = mine[0] if scoring else None
            generated = mine[1:] if scoring else mine
            answers += generated
            firsts += generated[:1]
            for j in range(req.n):
                answer = generated[j] if generated else None
                full = (text if req.echo else "") + (answer.text if answer else "")
                logprobs = None
                if req.logprobs is not None:
                    entries = (scored or []) + ((answer.logprobs or []) if answer is not None else [])
                    logprobs = _completion_logprobs(entries, token_text)
                choices.append({"index": i * req.n + j, "text": full, "logprobs": logprobs,
                                "finish_reason": answer.finish_reason if answer else "length"})
        return {**meta, "choices": choices, "usage": _usage([len(ids) for ids, _, _ in items], answers, firsts)}

    @functools.lru_cache(maxsize=65536)
    def token_text(token: int) -> str:
        """A token's own text; bytes of a character split across tokens as ``bytes:\\xNN`` (OpenAI's way)."""
        text = tokenizer.decode([token])
        if "\ufffd" in text:
            raw = tokenizer.convert_ids_to_tokens(token)
            data = _byte_level(raw)
            if data is not None:
                return "bytes:" + "".join(f"\\x{b:02x}" for b in data)
        return text

    return app


def _cancel(job) -> None:
    cancel = getattr(job, "cancel", None)
    if cancel is not None:
        cancel()


def _usage(prompt_lengths: list[int], answers: list, firsts: list) -> dict:
    """OpenAI's usage block: the prompts counted once each, every choice's tokens, and the prompt
    tokens whose KV came from the prefix cache."""
    prompt = sum(prompt_lengths)
    completion = sum(a.completion_tokens for a in answers)
    cached = sum(getattr(a, "cached_tokens", 0) for a in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


_BYTE_DECODER: dict[str, int] | None = None


def _byte_level(token: str | None) -> bytes | None:
    """The bytes of a byte-level BPE token string (GPT-2's alphabet), or None if it is not one."""
    global _BYTE_DECODER
    if token is None:
        return None
    if _BYTE_DECODER is None:
        visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
            list(range(ord("®"), ord("ÿ") + 1))
        codes, extra = list(visible), 0
        for b in range(256):
            if b not in visible:
                visible.append(b)
                codes.append(256 + extra)
                extra += 1
        _BYTE_DECODER = {chr(c): b for b, c in zip(visible, codes)}
    try:
        return bytes(_BYTE_DECODER[ch] for ch in token)
    except KeyError:
        return None


def _completion_logprobs(entries, token_text, offset: int = 0) -> dict:
    """OpenAI's completions logprobs of ``entries`` (``TokenLogprob`` items): ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (a dict per token of the top alternatives and the token
    itself; None where the logprob is None: the first prompt token) and ``text_offset`` (where each
    token starts in the choice's text, counting from ``offset``)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for entry in entries:
        text = token_text(entry.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(entry.logprob)
        if entry.logprob is None:
            out["top_logprobs"].append(None)
        else:
            alternatives: dict[str, float] = {}
            for alt, value in entry.top:
                alternatives.setdefault(token_text(alt), value)
            alternatives.setdefault(text, entry.logprob)
            out["top_logprobs"].append(alternatives)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_logprobs(entries, token_text) -> list[dict]:
    """OpenAI's chat logprobs ``content``: token, logprob, bytes and ``top_logprobs`` for each token."""
    def item(token: int, logprob: float) -> dict:
        text = token_text(token)
        if text.startswith("bytes:"):
            data = list(bytes(int(h, 16) for h in text[len("bytes:"):].split("\\x")[1:]))
        else:
            data = list(text.encode("utf-8"))
        return {"token": text, "logprob": logprob, "bytes": data}

    return [{**item(e.token, e.logprob), "top_logprobs": [item(a, v) for a, v in e.top]} for e in entries or []]


def _lower_priority() -> None:
    """Nice the calling thread (Linux threads have their own nice value): on a busy machine the
    kernel then gives the event loop and the generation thread the cores first."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


async def _disconnected(request: Request) -> None:
    """Return when the client has gone (the body is already read, so only a disconnect comes)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _parse(raw: bytes, model: type[BaseModel]):
    """The body as ``model``, whatever the Content-Type says (curl without -H sends a form type)."""
    try:
        data = json.loads(raw)
    except RecursionError:  # json.loads recurses once per level: 100k nested brackets exhaust the stack
        raise ApiError(400, "the request body is JSON nested too deeply to parse") from None
    except ValueError as exc:  # also bad UTF-8 and integers of more than 4300 digits
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:  # pydantic stops at its own nesting limit, which lands here too
        raise ApiError(422, describe_errors(exc.errors())) from None
    except RecursionError:
        raise ApiError(400, "the request body is JSON nested too deeply to validate") from None


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _Stream:
    """Server-sent events of one streaming request with one or more choices (the k-th job is
    choice k): text chunks as each choice's text is generated (with the logprobs of the tokens
    generated since its previous chunk, when asked for), a finish chunk per choice, the usage chunk
    when ``stream_options.include_usage`` is set, then [DONE]."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_text_for(self, index: int):
        def on_text(text: str) -> None:  # called from the generation thread
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ("text", index, text))
        return on_text

    def chat_events(self, jobs: list, meta: dict, prompt_tokens: int, include_usage: bool, token_text):
        extra = {"usage": None} if include_usage else {}

        def chunk(index: int, delta: dict, logprobs, finish: str | None = None) -> str:
            lp = None if logprobs is None else {"content": _chat_logprobs(logprobs, token_text)}
            return _sse({**meta, "object": "chat.completion.chunk", **extra,
                         "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}]})

        return self._events(
            jobs, meta, prompt_tokens, include_usage, "chat.completion.chunk",
            start=lambda j: chunk(j, {"role": "assistant", "content": ""}, None),
            piece=lambda j, text, lp: chunk(j, {"content": text}, lp),
            finish=lambda j, answer, lp: chunk(j, {}, lp, answer.finish_reason))

    def completion_events(self, jobs: list, meta: dict, prompt_tokens: int, include_usage: bool, token_text):
        extra = {"usage": None} if include_usage else {}
        offsets = [0] * len(jobs)

        def chunk(index: int, text: str, logprobs, finish: str | None = None) -> str:
            lp = None
            if logprobs is not None:
                lp = _completion_logprobs(logprobs, token_text, offsets[index])
                offsets[index] += sum(len(t) for t in lp["tokens"])
            return _sse({**meta, "object": "text_completion", **extra,
                         "choices": [{"index": index, "text": text, "logprobs": lp, "finish_reason": finish}]})

        return self._events(
            jobs, meta, prompt_tokens, include_usage, "text_completion", start=None,
            piece=lambda j, text, lp: chunk(j, text, lp),
            finish=lambda j, answer, lp: chunk(j, "", lp, answer.finish_reason))

    async def _events(self, jobs: list, meta: dict, prompt_tokens: int, include_usage: bool, kind: str, *,
                      start, piece, finish):
        loop, queue = self.loop, self.queue

        def finished(index: int, future) -> None:
            exc = future.exception()
            item = ("error", index, exc) if exc is not None else ("done", index, future.result())
            loop.call_soon_threadsafe(queue.put_nowait, item)

        for index, job in enumerate(jobs):
            job.future.add_done_callback(functools.partial(finished, index))
        sent = [0] * len(jobs)

        def new_logprobs(index: int, final=None):
            """The logprobs of ``jobs[index]``'s tokens not sent yet (None: the request asked for none)."""
            job = jobs[index]
            if job.logprobs is None:
                return None
            source = final if final is not None else getattr(job, "_logprobs", None) or []
            fresh = list(source[sent[index]:])
            sent[index] += len(fresh)
            return fresh

        answers = [None] * len(jobs)
        try:
            if start is not None:
                for index in range(len(jobs)):
                    yield start(index)
            left = len(jobs)
            while left:
                what, index, value = await queue.get()
                if what == "text":
                    yield piece(index, value, new_logprobs(index))
                elif what == "done":
                    answers[index] = value
                    left -= 1
                    yield finish(index, value, new_logprobs(index, value.logprobs or []))
                else:
                    error = "timeout" if isinstance(value, GenerationTimeout) else "server_error"
                    yield _sse({"error": {"message": str(value), "type": error}})
                    break
            else:
                if include_usage:
                    yield _sse({**meta, "object": kind, "choices": [],
                                "usage": _usage([prompt_tokens], answers, answers[:1])})
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                job.cancel()  # the client went away (or we are done): stop generating


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_serve_arguments(parser)


def check_serve_arguments(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for name, low in (("max_batch_size", 1), ("max_queue", 0), ("max_new_tokens", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        raise ValueError(f"--max_body_bytes must be at least 1, got {args.max_body_bytes}")
    if args.max_length is not None and args.max_length < 2:
        raise ValueError(f"--max_length must be at least 2, got {args.max_length}")
    if not 0 <= args.temperature <= 100 or not 0 < args.top_p <= 1:  # written so NaN fails too
        raise ValueError(f"--temperature must be in [0, 100] and --top_p in (0, 1], got {args.temperature} and "
                         f"{args.top_p}")
    for name in ("request_timeout", "body_timeout", "header_timeout", "keep_alive_timeout"):
        if not 0 < getattr(args, name) < float("inf"):
            raise ValueError(f"--{name} must be a positive number of seconds, got {getattr(args, name)}")
    for name in ("max_connections", "max_header_bytes"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        raise ValueError(f"--max_prompt_chars must be at least 1, got {args.max_prompt_chars}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api_key must not be empty")
    if args.kv_cache_bytes is not None and args.kv_cache_bytes < 1:
        raise ValueError(f"--kv_cache_bytes must be at least 1, got {args.kv_cache_bytes}")
    if args.kv_block_size < 1:
        raise ValueError(f"--kv_block_size must be at least 1, got {args.kv_block_size}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served_model_name must not be empty")
    parse_lora_modules(args.lora_modules, args.served_model_name or os.path.basename(os.path.abspath(args.model)))


def parse_lora_modules(specs: Sequence[str], base_name: str) -> tuple[tuple[str, str], ...]:
    """``NAME=DIR`` items of ``--lora_modules`` as ``((name, dir), ...)``; ValueError naming the bad item."""
    out: dict[str, str] = {}
    for spec in specs:
        name, eq, path = spec.partition("=")
        name, path = name.strip(), path.strip()
        if not eq or not name or not path:
            raise ValueError(f"--lora_modules: {spec!r} is not NAME=DIR (e.g. sql=out/sql-lora)")
        if name == base_name:
            raise ValueError(f"--lora_modules: the adapter name {name!r} is the base model's name; pick another "
                             "(or set --served_model_name)")
        if name in out:
            raise ValueError(f"--lora_modules: the adapter name {name!r} is given twice")
        if not os.path.isdir(path):
            raise ValueError(f"--lora_modules {name}: {path} is not a folder")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"--lora_modules {name}: {path} has no adapter_config.json (not a LoRA adapter folder; "
                             "shardwise finetune --lora_r writes one)")
        out[name] = path
    return tuple(out.items())


def run(args: argparse.Namespace) -> None:
    import uvicorn

    from shardwise.apps.serve_http import uvicorn_config

    if args.api_key is None and os.environ.get(API_KEY_ENV):
        args.api_key = os.environ[API_KEY_ENV]  # keeps the key out of the process list
    check_serve_arguments(args)
    chat = ChatModel.load(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
                          template=args.prompt_template)
    settings = ServeSettings(max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                             max_length=args.max_length, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p, request_timeout=args.request_timeout,
                             max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                             max_prompt_chars=args.max_prompt_chars, api_key=args.api_key,
                             served_model_name=args.served_model_name,
                             lora_modules=parse_lora_modules(args.lora_modules, args.served_model_name or chat.name),
                             kv_cache=args.kv_cache, kv_cache_bytes=args.kv_cache_bytes,
                             kv_block_size=args.kv_block_size)
    app = create_app(chat, settings)
    adapters = f", adapters {', '.join(n for n, _ in settings.lora_modules)}" if settings.lora_modules else ""
    print(f"shardwise serve: {args.model} as {settings.served_model_name or chat.name!r} "
          f"({chat.encoder.template} template, {chat.device}{adapters}) on http://{args.host}:{args.port}, "
          f"batches of up to {settings.max_batch_size}", flush=True)
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"shardwise serve: warning: listening on {args.host} without --api_key: anyone who can reach "
              "this port can use the model", file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn_config(app, args)).run()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except ValueError as exc:
        print(f"shardwise serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
