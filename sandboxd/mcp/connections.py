"""Connections of `sandboxd mcp --http`, bounded before anyone has shown a token.

uvicorn alone keeps a connection that sends nothing, or half a request head, for as long
as the peer likes, and accepts until the process runs out of file descriptors: then the
client with the token is the one refused. Here, on top of uvicorn's h11 protocol:

- a connection has ``head_timeout_s`` to deliver a whole request head, from when it opens
  or its last answer ends (bytes trickled in do not extend it), else it is closed;
- at most ``max_connections`` are open (fewer if the fd limit is lower). A new one past
  that closes a connection that is not in the middle of a request (idle, or still sending
  its head): the oldest of those that never carried the token first, and one that did
  (the token holder's idle keep-alive connection) only when no stranger is left to close.
  So a flood costs its own connections, never the client whose request is being served
  nor its next request; when every one is mid-request (held streams, only a token holder
  has those), the newcomer is answered 503 and closed.
- a request without the token is answered 401 with ``connection: close`` (sandboxd.mcp.http),
  so a stranger holds a slot for at most one head timeout.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import OrderedDict
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from sandboxd.logging import get_logger
from sandboxd.mcp.http import authorized
from sandboxd.wire import error_object, error_response

log = get_logger("sandboxd.mcp")

REPORT_INTERVAL_S = 10.0  # a flood is logged once per interval, not once per connection


class Admission:
    """The open connections and the cap they are held to: strangers oldest first, token holders by last request."""

    def __init__(self, cap: int, head_timeout_s: float, token: bytes) -> None:
        self.cap, self.head_timeout_s, self.token = cap, head_timeout_s, token
        self.strangers: OrderedDict[BoundedH11Protocol, None] = OrderedDict()  # never carried the token
        self.vouched: OrderedDict[BoundedH11Protocol, None] = OrderedDict()  # carried it; last request longest ago first
        self.evicted = self.evicted_vouched = self.refused = self.timed_out = 0
        self._reported = (0, 0, 0, 0)
        self._last_report = 0.0
        self._pending: asyncio.TimerHandle | None = None

    @property
    def open(self) -> int:
        return len(self.strangers) + len(self.vouched)

    def admit(self, new: BoundedH11Protocol) -> bool:
        """Make room for ``new`` (closing an idle connection, a stranger's first), or False: it is to be refused."""
        if self.open >= self.cap:
            victim = self._victim()
            if victim is None:
                self.refused += 1
                self.report()
                return False
            self.forget(victim)
            victim.transport.abort()  # its fd now, not after a FIN handshake
            self.report()
        self.strangers[new] = None
        return True

    def _victim(self) -> BoundedH11Protocol | None:
        """The oldest idle stranger, else the token holder's connection idle longest; None when all are serving."""
        victim = next((conn for conn in self.strangers if not conn.mid_request), None)
        if victim is not None:
            self.evicted += 1
            return victim
        victim = next((conn for conn in self.vouched if not conn.mid_request), None)
        if victim is not None:
            self.evicted_vouched += 1
        return victim

    def heard(self, conn: BoundedH11Protocol, authorization: bytes | None) -> None:
        """A request head arrived on ``conn``: with the token, it joins the token holders (a stranger no more)."""
        if conn in self.vouched:
            self.vouched.move_to_end(conn)
        elif conn in self.strangers and authorized(authorization.decode("latin-1") if authorization else None,
                                                   self.token):
            del self.strangers[conn]
            self.vouched[conn] = None

    def _report_pending(self) -> None:
        self._pending = None
        self.report()

    def forget(self, conn: BoundedH11Protocol) -> None:
        self.strangers.pop(conn, None)
        self.vouched.pop(conn, None)

    def report(self) -> None:
        now = time.monotonic()
        counts = (self.evicted, self.evicted_vouched, self.refused, self.timed_out)
        if counts == self._reported:
            return
        if now - self._last_report < REPORT_INTERVAL_S:
            if self._pending is None:  # a flood that stops within the interval is still told
                wait = REPORT_INTERVAL_S - (now - self._last_report)
                self._pending = asyncio.get_running_loop().call_later(wait, self._report_pending)
            return
        self._last_report = now
        evicted, evicted_vouched, refused, timed_out = (c - r for c, r in zip(counts, self._reported))
        self._reported = counts
        log.warning("mcp_http_connections_bounded", cap=self.cap, open=self.open, closed_oldest_idle=evicted,
                    closed_idle_with_token=evicted_vouched, refused_all_busy=refused, closed_without_a_head=timed_out,
                    hint="many connections without a request: a client that does not close them, or a flood; "
                         "raise --max-connections if a legitimate host needs more")


_BUSY_BODY = json.dumps(error_response(None, error_object(
    -32000, "every connection this server allows is serving a request; retry later (limit: --max-connections)."))).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"retry-after: 1\r\ncontent-length: " + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head and a place in ``admission``."""

    admission: ClassVar[Admission]
    _head_timer: asyncio.TimerHandle | None = None
    _answered = False  # a response has been sent on this connection
    _heard: Any = None  # the request cycle whose head Admission was last told of

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
        if self.mid_request and self._heard is not self.cycle:  # a new request's head: once, not per body chunk
            self._heard = self.cycle
            self._stop_head_timer()
            self.admission.heard(self, next((value for name, value in self.headers if name == b"authorization"), None))

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
