"""Connections of `sandboxd mcp --http`, bounded before anyone has shown a token.

uvicorn alone keeps a connection that sends nothing, or half a request head, for as long
as the peer likes, and accepts until the process runs out of file descriptors: then the
client with the token is the one refused. Here, on top of uvicorn's h11 protocol:

- a connection has ``head_timeout_s`` to deliver a whole request head, from when it opens
  or its last answer ends (bytes trickled in do not extend it), else it is closed;
- at most ``max_connections`` are open (fewer if the fd limit is lower). A new one past
  that closes the oldest connection that is not in the middle of a request (idle, or
  still sending its head), so a flood of silent connections costs the newest of them,
  never the client whose request is being served; when every one is mid-request (held
  streams, only a token holder has those), the newcomer is answered 503 and closed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from sandboxd.logging import get_logger

log = get_logger("sandboxd.mcp")

REPORT_INTERVAL_S = 10.0  # a flood is logged once per interval, not once per connection


class Admission:
    """The open connections, oldest first, and the cap they are held to."""

    def __init__(self, cap: int, head_timeout_s: float) -> None:
        self.cap, self.head_timeout_s = cap, head_timeout_s
        self.open: OrderedDict[BoundedH11Protocol, None] = OrderedDict()
        self.evicted = self.refused = self.timed_out = 0
        self._reported = (0, 0, 0)
        self._last_report = 0.0
        self._pending: asyncio.TimerHandle | None = None

    def admit(self, new: BoundedH11Protocol) -> bool:
        """Make room for ``new`` (closing the oldest connection not mid-request), or False: it is to be refused."""
        if len(self.open) >= self.cap:
            victim = next((conn for conn in self.open if not conn.mid_request), None)
            if victim is None:
                self.refused += 1
                self.report()
                return False
            self.evicted += 1
            self.forget(victim)
            victim.transport.abort()  # its fd now, not after a FIN handshake
            self.report()
        self.open[new] = None
        return True

    def _report_pending(self) -> None:
        self._pending = None
        self.report()

    def forget(self, conn: BoundedH11Protocol) -> None:
        self.open.pop(conn, None)

    def report(self) -> None:
        now = time.monotonic()
        counts = (self.evicted, self.refused, self.timed_out)
        if counts == self._reported:
            return
        if now - self._last_report < REPORT_INTERVAL_S:
            if self._pending is None:  # a flood that stops within the interval is still told
                wait = REPORT_INTERVAL_S - (now - self._last_report)
                self._pending = asyncio.get_running_loop().call_later(wait, self._report_pending)
            return
        self._last_report = now
        evicted, refused, timed_out = (c - r for c, r in zip(counts, self._reported))
        self._reported = counts
        log.warning("mcp_http_connections_bounded", cap=self.cap, open=len(self.open), closed_oldest_idle=evicted,
                    refused_all_busy=refused, closed_without_a_head=timed_out,
                    hint="many connections without a request: a client that does not close them, or a flood; "
                         "raise --max-connections if a legitimate host needs more")


_BUSY_BODY = json.dumps({"jsonrpc": "2.0", "id": None, "error": {
    "code": -32000, "message": "every connection this server allows is serving a request; retry later "
                               "(limit: --max-connections)."}}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"retry-after: 1\r\ncontent-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head and a place in ``admission``."""

    admission: ClassVar[Admission]
    _head_timer: asyncio.TimerHandle | None = None
    _answered = False  # a response has been sent on this connection

    @classmethod
    def bound_by(cls, admission: Admission) -> type[BoundedH11Protocol]:
        return type("BoundedH11Protocol", (cls,), {"admission": admission})

    @property
    def mid_request(self) -> bool:
        """A request head arrived and its answer is not complete: this connection is serving someone."""
        return self.cycle is not None and not self.cycle.response_complete

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if not self.admission.admit(self):
            transport.write(_BUSY)
            transport.close()
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self.admission.forget(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.mid_request:
            self._stop_head_timer()

    def on_response_complete(self) -> None:
        self._answered = True
        self._await_head()  # before super(): a pipelined request it hands on stops this timer again
        super().on_response_complete()

    def _await_head(self) -> None:
        self._stop_head_timer()
        self._head_timer = self.loop.call_later(self.admission.head_timeout_s, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.mid_request and not self.transport.is_closing():
            self.admission.forget(self)
            self.transport.abort()
            if not self._answered:  # an idle keep-alive connection closing is routine, not worth a warning
                self.admission.timed_out += 1
                self.admission.report()
