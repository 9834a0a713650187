"""uvicorn's h11 connection with a read timeout.

uvicorn times out a kept-alive connection only after a response, so a client that connects and sends
nothing, sends half a request head, or stops half way through a body holds its connection (and at
shutdown, the whole server) for ever. Here every request must arrive in full, head and body, within
`read_timeout` seconds of its first byte (of the connection opening, for the first request); a
connection still receiving one then is closed. Once a shutdown has begun, a request still arriving
gets at most `shutdown_timeout` more seconds (`ddtree serve` passes its grace period).
"""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("ddtree.server")


class TimedH11Protocol(H11Protocol):
    read_timeout: float = 30.0
    shutdown_timeout: float = 30.0

    @classmethod
    def with_timeouts(cls, read_timeout: float, shutdown_timeout: float) -> type[TimedH11Protocol]:
        """The protocol class to give uvicorn (`Config(http=...)`), with these timeouts."""
        return type(cls.__name__, (cls,), {"read_timeout": read_timeout, "shutdown_timeout": shutdown_timeout})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._read_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm(self.read_timeout)  # a new connection owes its first request

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._receiving():
            if self._read_timer is None:  # the first bytes of a request on a kept-alive connection
                self._arm(self.read_timeout)
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        super().shutdown()
        if self._read_timer is not None and self._read_timer.when() > self.loop.time() + self.shutdown_timeout:
            self._arm(self.shutdown_timeout)

    def _receiving(self) -> bool:
        """A request is part way in: its body is arriving, or bytes of its head are buffered."""
        state = self.conn.their_state
        return state is h11.SEND_BODY or (state is h11.IDLE and bool(self.conn.trailing_data[0]))

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._on_read_timeout)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _on_read_timeout(self) -> None:
        self._read_timer = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            log.info("closing a connection from %s: no complete request within the read timeout",
                     "%s:%d" % self.client if self.client else "?")
            self.transport.close()
