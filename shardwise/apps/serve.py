"""Serve a fine-tuned chat model over HTTP (FastAPI + uvicorn).

    shardwise serve --model out --port 8000
    curl -X POST http://127.0.0.1:8000 -H 'Content-Type: application/json' \\
         -d '{"prompt": "你好", "history": []}'

Endpoints: ``POST /`` (prompt/history contract), ``POST /v1/chat/completions`` (OpenAI format,
``"stream": true`` for server-sent events) and ``GET /health``. Generation runs in a pool of
``--max_concurrency`` threads, never on the event loop; at most ``--max_queue`` more requests
wait, the rest get 503. See docs/finetune.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pydantic import BaseModel, ValidationError

from shardwise.apps.generation import ChatModel, GenerationLimits
from shardwise.apps.options import add_serve_arguments
from shardwise.apps.serve_schemas import ChatRequest, OpenAIRequest, describe_errors
from shardwise.data.chat import history_to_messages

__all__ = ["ApiError", "ServeSettings", "create_app", "main"]


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class ServeSettings:
    max_concurrency: int = 1
    max_queue: int = 32
    max_length: int | None = None  # default prompt+answer limit; None: the model's context length
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "server_error"}, "status": status}, status_code=status)


class _Gate:
    """Admission control: at most ``running + waiting`` requests in the house; generation in a thread pool."""

    def __init__(self, settings: ServeSettings) -> None:
        self.pool = ThreadPoolExecutor(settings.max_concurrency, thread_name_prefix="generate")
        self.limit = settings.max_concurrency + settings.max_queue
        self.active = 0

    def admit(self) -> None:
        if self.active >= self.limit:
            raise ApiError(503, f"server busy: {self.active} requests running or queued "
                                f"(--max_concurrency + --max_queue = {self.limit}); retry later")
        self.active += 1

    def release(self) -> None:
        self.active -= 1

    async def run(self, fn):
        self.admit()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, fn)
        finally:
            self.release()


def create_app(chat: ChatModel, settings: ServeSettings = ServeSettings()) -> FastAPI:
    app = FastAPI(title="shardwise chat server")
    gate = _Gate(settings)
    app.state.chat, app.state.gate = chat, gate

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.message)

    def prompt_ids(messages) -> list[int]:
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

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": chat.name, "device": str(chat.device), "template": chat.encoder.template,
                "active_requests": gate.active}

    @app.post("/")
    async def chat_root(request: Request):
        req = await _parse(request, ChatRequest)
        history = [list(pair) for pair in (req.history or [])]
        ids = prompt_ids(history_to_messages(req.prompt, history))
        lim = limits(len(ids), max_length=req.max_length, temperature=req.temperature, top_p=req.top_p)
        answer = await gate.run(lambda: chat.generate(ids, lim))
        return {"response": answer.text, "history": history + [[req.prompt, answer.text]], "status": 200,
                "time": datetime.now().strftime("%Y-%m-%d %H:%M:%S")}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, OpenAIRequest)
        ids = prompt_ids([{"role": m.role, "content": m.content} for m in req.messages])
        lim = limits(len(ids), max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model or chat.name}
        if req.stream:  # admitted (or refused with 503) before the 200 response starts
            return StreamingResponse(_start_stream(chat, gate, ids, lim, meta), media_type="text/event-stream")
        answer = await gate.run(lambda: chat.generate(ids, lim))
        return {**meta, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                             "finish_reason": answer.finish_reason}],
                "usage": {"prompt_tokens": answer.prompt_tokens, "completion_tokens": answer.completion_tokens,
                          "total_tokens": answer.prompt_tokens + answer.completion_tokens}}

    return app


async def _parse(request: Request, model: type[BaseModel]):
    """The body as ``model``, whatever the Content-Type says (curl without -H sends a form type)."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ApiError(422, describe_errors(exc.errors())) from None


def _start_stream(chat: ChatModel, gate: _Gate, ids: list[int], lim: GenerationLimits, meta: dict):
    """Admit the request and start generating now; return the server-sent events: a role chunk,
    content chunks as text is generated, a finish chunk, then [DONE]."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()
    gate.admit()

    def work():
        try:
            answer = chat.generate(ids, lim, cancel=cancel,
                                   on_text=lambda t: loop.call_soon_threadsafe(queue.put_nowait, ("text", t)))
            loop.call_soon_threadsafe(queue.put_nowait, ("done", answer))
        except Exception as exc:  # reported to the client as the stream's last event
            loop.call_soon_threadsafe(queue.put_nowait, ("error", exc))

    future = loop.run_in_executor(gate.pool, work)
    future.add_done_callback(lambda _: gate.release())

    def event(delta: dict, finish: str | None = None) -> str:
        chunk = {**meta, "object": "chat.completion.chunk",
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    return _events(queue, cancel, event)


async def _events(queue: asyncio.Queue, cancel: threading.Event, event):
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
                yield f"data: {json.dumps({'error': {'message': str(value), 'type': 'server_error'}})}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        cancel.set()  # the client went away (or we are done): stop generating


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_serve_arguments(parser)


def check_serve_arguments(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    for name, low in (("max_concurrency", 1), ("max_queue", 0), ("max_new_tokens", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if args.max_length is not None and args.max_length < 2:
        raise ValueError(f"--max_length must be at least 2, got {args.max_length}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ValueError("--temperature must be >= 0 and --top_p in (0, 1]")


def run(args: argparse.Namespace) -> None:
    import uvicorn

    check_serve_arguments(args)
    chat = ChatModel.load(args.model, device=args.device, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
                          template=args.prompt_template)
    settings = ServeSettings(max_concurrency=args.max_concurrency, max_queue=args.max_queue,
                             max_length=args.max_length, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_p=args.top_p)
    app = create_app(chat, settings)
    print(f"shardwise serve: {args.model} ({chat.encoder.template} template, {chat.device}) on "
          f"http://{args.host}:{args.port}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)


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
