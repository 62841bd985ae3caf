"""uvicorn's HTTP/1.1 protocol (h11) with a deadline for a request's headers, which uvicorn does not have.

uvicorn closes an idle keep-alive connection after `timeout_keep_alive`, but a client that opens a connection and
sends half a request line, or half its headers, holds the connection for as long as it likes: the app is not
called before the headers are complete, so the guard (guard.py, which bounds the body's time) cannot see it.
`HeaderTimeoutProtocol` starts a clock whenever the server waits for a request's headers (on connect, and when
the next request of a kept-alive connection starts to arrive) and answers 408 and closes the connection when
the headers are not complete within `HEADER_TIMEOUT` seconds.

    uvicorn.Config(app, http=HeaderTimeoutProtocol, ...)     # lmhead serve does this
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT = 10.0  # seconds from the first byte of a request (or the connection) to its last header


def _timeout_response(seconds: float) -> bytes:
    body = f'{{"detail": "request headers not received within {seconds:g} s"}}'.encode()
    head = (f"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    return head + body


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol, plus 408 and close for headers that take longer than `header_timeout` seconds."""

    header_timeout = HEADER_TIMEOUT

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._header_clock: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._start_clock()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE:  # a new request starts to arrive (or keeps arriving)
            self._start_clock()
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # its headers are complete: the guard times the body
            self._stop_clock()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _start_clock(self) -> None:
        if self._header_clock is None:
            self._header_clock = self.loop.call_later(self.header_timeout, self._headers_timed_out)

    def _stop_clock(self) -> None:
        if self._header_clock is not None:
            self._header_clock.cancel()
            self._header_clock = None

    def _headers_timed_out(self) -> None:
        self._header_clock = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.write(_timeout_response(self.header_timeout))
            self.transport.close()
