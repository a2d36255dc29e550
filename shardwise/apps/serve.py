"""Serve a fine-tuned chat model over HTTP (FastAPI + uvicorn).

    shardwise serve --model out --port 8000
    curl -X POST http://127.0.0.1:8000 -H 'Content-Type: application/json' \\
         -d '{"prompt": "你好", "history": []}'

Endpoints: ``POST /`` (prompt/history contract), ``POST /v1/chat/completions`` (OpenAI format,
``"stream": true`` for server-sent events), ``GET /health`` (liveness; says "busy" when full) and
``GET /ready`` (503 when full). Concurrent requests are generated together
(``shardwise.apps.batching``: up to ``--max_batch_size`` in one decoding step, new requests
joining at the next step); at most ``--max_queue`` more are prepared or wait, the rest get 503.
Nothing slow runs on the event loop: reading JSON, validating and tokenising happen in worker
threads (bodies over 64 KiB in a lane of their own, so huge prompts cannot hold up small ones),
generation in the batching thread. A prompt over ``--max_prompt_chars`` gets 400 before it is
tokenised; a body over ``--max_body_bytes`` gets 413 before it is parsed; with ``--api_key``
every request needs ``Authorization: Bearer <key>`` (401 otherwise); a request that outlives
``--request_timeout`` gets 504; a client that disconnects leaves the batch. Connection limits
(header and body timeouts, ``--max_connections``) are in ``serve_http.py``. See docs/finetune.md.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from shardwise.apps.batching import BatchedGenerator, GenerationTimeout, Job, RequestFailed
from shardwise.apps.generation import ChatModel, GenerationLimits
from shardwise.apps.options import add_serve_arguments
from shardwise.apps.serve_schemas import ChatRequest, OpenAIRequest, describe_errors
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
    kind = {401: "authentication_error", 408: "timeout", 413: "invalid_request_error", 504: "timeout"}.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return JSONResponse({"error": {"message": message, "type": kind}, "status": status}, status_code=status,
                        headers=headers)


class _Gate:
    """Admission control: at most ``max_batch_size + max_queue`` requests being prepared (parsed,
    tokenised), waiting or generating; the rest get 503 before any work is spent on them."""

    def __init__(self, settings: ServeSettings) -> None:
        self.limit = settings.max_batch_size + settings.max_queue
        self.active = 0
        self._lock = threading.Lock()

    def admit(self) -> None:
        with self._lock:
            if self.active >= self.limit:
                raise ApiError(503, f"server busy: {self.active} requests being prepared, generating or queued "
                                    f"(--max_batch_size + --max_queue = {self.limit}); retry later",
                               {"Retry-After": "1"})
            self.active += 1

    def release(self, *_) -> None:
        with self._lock:
            self.active -= 1

    @property
    def full(self) -> bool:
        return self.active >= self.limit


class _ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


def create_app(chat: ChatModel, settings: ServeSettings = ServeSettings()) -> FastAPI:
    app = FastAPI(title="shardwise chat server")
    gate = _Gate(settings)
    engine = BatchedGenerator(chat, max_batch_size=settings.max_batch_size)
    # JSON, validation and tokenising run off the event loop, in two lanes: a large body (up to
    # --max_body_bytes) waits for the one large-body thread, so a few clients sending huge prompts
    # cannot hold up the small requests, which have two threads of their own.
    small_lane = ThreadPoolExecutor(2, thread_name_prefix="prepare")
    large_lane = ThreadPoolExecutor(1, thread_name_prefix="prepare-large", initializer=_lower_priority)
    max_tokens, max_chars, max_body = prompt_limits(settings, chat.context_length)
    app.state.chat, app.state.gate, app.state.engine = chat, gate, engine
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

    def limits(prompt_len: int, *, max_length=None, max_tokens=None, temperature=None, top_p=None):
        context = chat.context_length
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
        return GenerationLimits(max_new_tokens=new,
                                temperature=settings.temperature if temperature is None else float(temperature),
                                top_p=settings.top_p if top_p is None else float(top_p))

    async def admitted(request: Request, prepare, on_text_for=None):
        """Read the body, take a place (503 if none), prepare off the loop, submit; the place is
        given back when the job ends or preparing fails."""
        authorise(request)
        raw = await read_body(request)
        gate.admit()
        try:
            lane = large_lane if len(raw) > LARGE_BODY else small_lane
            prepared = await asyncio.get_running_loop().run_in_executor(lane, prepare, raw)
            *rest, ids, lim = prepared
            on_text = on_text_for(rest[0]) if on_text_for is not None else None
            job = engine.submit(ids, lim, on_text=on_text, timeout=settings.request_timeout)
        except BaseException:
            gate.release()
            raise
        job.future.add_done_callback(gate.release)
        return job, prepared

    async def answer_of(job: Job, request: Request):
        """The job's answer; the job is cancelled (leaves the batch at the next step) when the
        client disconnects or this handler is cancelled."""
        done = asyncio.wrap_future(job.future)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.cancel()
            raise
        finally:
            gone.cancel()
        if not done.done():
            job.cancel()
            raise _ClientGone()
        try:
            return done.result()
        except GenerationTimeout as exc:
            raise ApiError(504, f"{exc} (--request_timeout); {exc.answer.completion_tokens} tokens were "
                                "generated") from None
        except RequestFailed as exc:
            raise ApiError(500, str(exc)) from None

    def status() -> dict:
        return {"status": "busy" if gate.full else "ok", "ready": not gate.full, "model": chat.name,
                "device": str(chat.device), "template": chat.encoder.template, "active_requests": gate.active,
                "capacity": gate.limit, "generating": engine.running, "waiting": engine.waiting,
                "decode_steps": engine.steps}

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

    @app.post("/")
    async def chat_root(request: Request):
        def prepare(raw: bytes):
            req = _parse(raw, ChatRequest)
            history = [list(pair) for pair in (req.history or [])]
            ids = prompt_ids(history_to_messages(req.prompt, history))
            lim = limits(len(ids), max_length=req.max_length, temperature=req.temperature, top_p=req.top_p)
            return req, history, ids, lim

        job, (req, history, _, _) = await admitted(request, prepare)
        answer = await answer_of(job, request)
        return {"response": answer.text, "history": history + [[req.prompt, answer.text]], "status": 200,
                "time": datetime.now().strftime("%Y-%m-%d %H:%M:%S")}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        def prepare(raw: bytes):
            req = _parse(raw, OpenAIRequest)
            ids = prompt_ids([{"role": m.role, "content": m.content} for m in req.messages])
            lim = limits(len(ids), max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p)
            return req, ids, lim

        stream = _Stream()
        job, (req, _, _) = await admitted(request, prepare,
                                          on_text_for=lambda req: stream.on_text if req.stream else None)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model or chat.name}
        if req.stream:  # admitted (or refused with 503) before the 200 response starts
            return StreamingResponse(stream.events(job, meta), media_type="text/event-stream")
        answer = await answer_of(job, request)
        return {**meta, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                             "finish_reason": answer.finish_reason}],
                "usage": {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
                          "total_tokens": answer.prompt_tokens + answer.completion_tokens}}

    return app


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


class _Stream:
    """Server-sent events of one streaming request: a role chunk, content chunks as text is
    generated, a finish chunk, then [DONE]."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_text(self, text: str) -> None:  # called from the generation thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("text", text))

    def events(self, job: Job, meta: dict):
        def finished(future) -> None:
            exc = future.exception()
            item = ("error", exc) if exc is not None else ("done", future.result())
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

        job.future.add_done_callback(finished)

        def event(delta: dict, finish: str | None = None) -> str:
            chunk = {**meta, "object": "chat.completion.chunk",
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

        return _events(self.queue, job, event)


async def _events(queue: asyncio.Queue, job: Job, event):
    try:
        yield event({"role": "assistant", "content": ""})
        while True:
            kind, value = await queue.get()
            if kind == "text":
                yield event({"content": value})
            elif kind == "done":
                yield event({}, value.finish_reason)
                break
            else:
                kind = "timeout" if isinstance(value, GenerationTimeout) else "server_error"
                yield f"data: {json.dumps({'error': {'message': str(value), 'type': kind}})}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
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
                             max_prompt_chars=args.max_prompt_chars, api_key=args.api_key)
    app = create_app(chat, settings)
    print(f"shardwise serve: {args.model} ({chat.encoder.template} template, {chat.device}) on "
          f"http://{args.host}:{args.port}, batches of up to {settings.max_batch_size}", flush=True)
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
