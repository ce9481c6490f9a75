"""An HTTP connection: uvicorn's h11 protocol with a deadline for each request's headers.

uvicorn (0.54) times out only an idle keep-alive connection (`timeout_keep_alive`, reset by any byte):
a client that connects and sends nothing, or trickles a request's headers a byte at a time
(slowloris), holds its connection for ever — and the app never sees it, since ASGI starts once the
headers are complete. Here a connection must deliver a request's complete headers within
`header_timeout` seconds of opening, or of the first byte after its previous response (hyper's
rule: a client's pool may open connections ahead of use); else it is closed. The body's deadline
is the app's (`app.BodyLimit`: a 408), which sees the body as it arrives.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("neuron_moe.serve")
HEADER_TIMEOUT_S = 10.0  # headers fit in a packet or two: 10 s is far beyond any honest client's latency


class HeaderTimeoutProtocol(H11Protocol):
    def __init__(self, *args, header_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._deadline: asyncio.TimerHandle | None = None
        self._parsed = None  # the request cycle whose headers came in last

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first byte of the next request
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._parsed:  # a request's headers are in
            self._parsed = self.cycle
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.header_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            log.info(
                "closing a connection from %s: no complete request headers within %g s",
                "%s:%d" % self.client if self.client else "?",
                self.header_timeout,
            )
            self.transport.close()


def protocol(header_timeout: float):
    """The `http` protocol class for uvicorn.Config."""
    return functools.partial(HeaderTimeoutProtocol, header_timeout=header_timeout)
