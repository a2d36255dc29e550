"""The connection layer of ``shardwise serve``: uvicorn's settings, plus the two limits uvicorn lacks.

uvicorn already gives: ``timeout_keep_alive`` (an idle keep-alive connection is closed),
``limit_concurrency`` (past it, a new request gets 503), ``h11_max_incomplete_event_size`` (request
headers larger than this get 400) and ``backlog``. It has no timeout for a client that sends its
headers slowly, and it keeps accepting connections past ``limit_concurrency``, so 1000 slow
clients hold 1000 sockets forever. :class:`GuardedH11Protocol` adds both:

* a connection has ``header_timeout`` seconds, from opening (or from its previous response), to
  finish sending request headers; then it gets ``408`` and is closed;
* a connection opened while ``max_connections`` are already open gets ``503`` and is closed at once.

The body has its own limit, ``--body_timeout``, enforced where the app reads it (``serve.py``).
"""
from __future__ import annotations

import argparse
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["GuardedH11Protocol", "uvicorn_config"]

logger = logging.getLogger("shardwise")

_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s")
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
         b"content-length: %d\r\n\r\n%s")


def _raw(template: bytes, text: str) -> bytes:
    body = text.encode()
    return template % (len(body), body)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline and a cap on open connections."""

    header_timeout: float = 10.0
    max_connections: int | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            transport.write(_raw(_BUSY, f"too many open connections (--max_connections {self.max_connections})"))
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.our_state is h11.IDLE:  # nothing of a response is on the wire yet
            self.transport.write(_raw(_TIMEOUT, f"request headers not received within --header_timeout "
                                                f"({self.header_timeout:g} s)"))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in: the app's limits take over
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets its own deadline

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def uvicorn_config(app, args: argparse.Namespace):
    """The ``uvicorn.Config`` for ``shardwise serve``'s flags (used by ``run`` and by the tests)."""
    import uvicorn

    protocol = type("ServeH11Protocol", (GuardedH11Protocol,),
                    {"header_timeout": args.header_timeout, "max_connections": args.max_connections})
    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, http=protocol,
                          timeout_keep_alive=args.keep_alive_timeout,
                          # uvicorn counts the asking connection too: +1 so max_connections can all be served
                          limit_concurrency=args.max_connections + 1,
                          h11_max_incomplete_event_size=args.max_header_bytes, timeout_graceful_shutdown=10)
