"""uvicorn's httptools connection with a read timeout and a limit on a request's head.

uvicorn times out a kept-alive connection only after a response, so a client that connects and sends
nothing, sends half a request head, or stops half way through a body holds its connection (and at
shutdown, the whole server) for ever. Here every request must arrive in full, head and body, within
`read_timeout` seconds of its first byte (of the connection opening, for the first request); a
connection still receiving one then is closed. Once a shutdown has begun, a request still arriving
gets at most `shutdown_timeout` more seconds (`ddtree serve` passes its grace period).

httptools' parser keeps a request's head, however long, until it ends; a head (request line and
headers) over `max_head_bytes` is answered 400 and its connection closed, as uvicorn answers a head
it cannot parse.

httptools (C) rather than h11 (Python): it parses a request and frames each write of a response in
about a third of h11's time, which a streamed request pays at its first token and at its end.
"""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("ddtree.server")


class HeadTooLong(Exception):
    """Raised from a parser callback: the request's head is over the limit."""


class TimedHttpProtocol(HttpToolsProtocol):
    read_timeout: float = 30.0
    shutdown_timeout: float = 30.0
    max_head_bytes: int = 16384

    @classmethod
    def with_limits(cls, read_timeout: float, shutdown_timeout: float, max_head_bytes: int) -> type[TimedHttpProtocol]:
        """The protocol class to give uvicorn (`Config(http=...)`), with these limits."""
        return type(cls.__name__, (cls,), {"read_timeout": read_timeout, "shutdown_timeout": shutdown_timeout,
                                           "max_head_bytes": max_head_bytes})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_timer: asyncio.TimerHandle | None = None
        self._receiving = False  # a request's first byte has come and its last has not
        self._in_head = False  # and its head has not ended
        self._head_bytes = 0  # its request line's and headers' bytes parsed so far
        self._head_bytes_received = 0  # bytes received since its first, while in its head
        super().connection_made(transport)
        self._arm(self.read_timeout)  # a new connection owes its first request

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.parser is None or self.transport.is_closing():
            return
        if self._in_head:  # a head not ended by this data (the parser holds a header until it ends)
            self._head_bytes_received += len(data)
            if self._head_bytes_received > self.max_head_bytes:
                self.logger.warning(self._head_refusal())
                self.send_400_response(self._head_refusal())
                return
        if self._receiving:
            if self._read_timer is None:  # the first bytes of a request on a kept-alive connection
                self._arm(self.read_timeout)
        else:
            self._disarm()

    def send_400_response(self, msg: str) -> None:
        super().send_400_response(self._head_refusal() if self._head_bytes > self.max_head_bytes else msg)

    def _head_refusal(self) -> str:
        return f"Request head over {self.max_head_bytes} bytes."

    def on_message_begin(self) -> None:
        self._receiving = self._in_head = True
        self._head_bytes = self._head_bytes_received = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))  # in pieces, maybe
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + len(b": \r\n"))
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        """Over the limit, the parser stops (uvicorn answers 400, `send_400_response`, and closes)."""
        self._head_bytes += size
        if self._head_bytes > self.max_head_bytes:
            raise HeadTooLong(self._head_refusal())

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._receiving = False
        super().on_message_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        super().shutdown()
        if self._read_timer is not None and self._read_timer.when() > self.loop.time() + self.shutdown_timeout:
            self._arm(self.shutdown_timeout)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._on_read_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_timeout(self) -> None:
        self._read_timer = None
        if (self._receiving or self.cycle is None) and not self.transport.is_closing():
            log.info("closing a connection from %s: no complete request within the read timeout",
                     "%s:%d" % self.client if self.client else "?")
            self.transport.close()
