"""One host, as the router reaches it: a small pool of connections, each with its own ids (``UpstreamIds``).

Connections are dialled on demand: the first call opens one, and another is opened while
every open one carries ``GROW_AT`` calls, up to ``MAX_CONNECTIONS`` (a host serves many
calls on one connection; more spread the reading and writing of a busy host). A
connection that dies fails its calls with ``UpstreamLost``: they may have run, so they are
never sent again. A host is its own pool: a slow host holds up none of another's calls.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Protocol

from sandboxd import strictjson
from sandboxd.client import DaemonUnreachable
from sandboxd.errors import BackendUnavailable
from sandboxd.lines import LineBuffer
from sandboxd.logging import get_logger, source
from sandboxd.router.ids import OnProgress, Slot, UpstreamIds, Verbatim, verbatim_answer
from sandboxd.wire import cancelled, encode, request

log = get_logger("sandboxd.router")

MAX_CONNECTIONS = 4
GROW_AT = 16  # calls in flight on every open connection before another is dialled
DIAL_TIMEOUT_S = 3.0


class Dial(Protocol):
    """Opens a connection to host ``node`` at ``address``: the cluster's mutual-TLS dial, or a unix socket in tests."""

    def __call__(self, node: str, address: str) -> Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]: ...


async def unix_dial(_node: str, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A host's unix socket as its address (tests; the cluster's hosts are dialled over TLS: router/view.py)."""
    return await asyncio.open_unix_connection(address)


class UpstreamLost(BackendUnavailable):
    """The host's connection closed with the call in flight: it may have run, so it is not sent again."""


class HostUnreachable(BackendUnavailable):
    """The host could not be dialled: nothing was sent, nothing ran."""


Notify = Callable[[str, dict[str, Any]], None]  # (host, a notification the host sent that is not progress)
Lost = Callable[["UpstreamConnection"], None]
WATCHES_PER_CONNECTION = 16  # what a host lets one connection watch (server/watch.py)


class UpstreamConnection(asyncio.Protocol):
    """One connection to a host: its requests in flight (``UpstreamIds``), read as the bytes arrive.

    The dial's streams hand over their transport (``set_protocol``): an answer then wakes its caller
    straight from ``data_received``, not through a reading task first (a loop turn per answer). A
    host sends nothing unasked, so nothing waits in the stream's buffer at the handover."""

    def __init__(self, node: str, writer: asyncio.StreamWriter, on_notification: Notify, on_lost: Lost) -> None:
        self.node = node
        self.ids = UpstreamIds()
        self.watching = 0  # users the router watches on this connection
        self._lines = LineBuffer()  # the host is trusted as far as framing goes (it is ours, and TLS-checked)
        self._on_notification, self._on_lost = on_notification, on_lost
        self.closed = False
        self._writer = writer  # kept: a stream writer collected closes its transport
        self.transport = writer.transport
        self.transport.set_protocol(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        slots = self.ids.lost()
        log.warning("router_host_connection_lost", node=self.node, calls_failed=len(slots),
                    error=str(exc) if exc else None, budget=source("host", self.node))
        for slot in slots:
            if not slot.waiter.done():
                slot.waiter.set_exception(UpstreamLost(
                    f"host {self.node} closed the connection while the call was in flight; it may have run, so "
                    "the router did not send it again. Check the host (its log), then call again."))
        self._on_lost(self)

    def data_received(self, data: bytes) -> None:
        self._received(data)

    def _received(self, data: bytes) -> None:
        for line in self._lines.feed(data):
            if not isinstance(line, bytes):
                continue
            passed = verbatim_answer(line)
            slot = None if passed is None else self.ids.take_verbatim(passed[0])
            if passed is not None and slot is not None:
                if not slot.waiter.done():
                    slot.waiter.set_result(Verbatim(passed[1]))
                continue
            try:
                message = strictjson.loads_line(line)
            except ValueError:
                log.warning("upstream_unreadable", node=self.node)
                continue
            if isinstance(message, dict):
                self._act(message)

    def _act(self, message: dict[str, Any]) -> None:
        step = self.ids.received(message)
        if step.action == "answer" and step.slot is not None and not step.slot.waiter.done():
            step.slot.waiter.set_result(step.message)
        elif step.action == "progress" and step.slot is not None and step.slot.on_progress is not None:
            step.slot.on_progress(step.message)
        elif step.action == "notify":
            self._on_notification(self.node, step.message)

    def send(self, method: str, params: Any, slot: Slot, rewrite: Callable[[Any, int], Any] | None = None) -> int:
        """Send a request under a fresh id (``rewrite(params, id)`` may put the id in its params too)."""
        upstream_id = self.ids.open(slot)
        if rewrite is not None:
            params = rewrite(params, upstream_id)
        self.write(request(upstream_id, method, params))
        return upstream_id

    def write(self, message: Any) -> None:
        if not self.closed and not self.transport.is_closing():
            self.transport.write(encode(message))

    def cancel(self, upstream_id: int, reason: str) -> None:
        if upstream_id in self.ids.slots:
            self.write(cancelled(upstream_id, reason))

    def close(self) -> None:
        self.transport.close()


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())


class Upstream:
    """Host ``node`` at ``address``; ``address`` follows the directory (a host that moved is dialled anew)."""

    def __init__(self, node: str, address: str, dial: Dial, on_notification: Notify, on_lost: Lost) -> None:
        self.node, self.address = node, address
        self._dial = dial
        self._on_notification, self._on_lost = on_notification, on_lost
        self.connections: list[UpstreamConnection] = []
        self._dialing: asyncio.Task[UpstreamConnection] | None = None

    @property
    def in_flight(self) -> int:
        return sum(len(conn.ids) for conn in self.connections)

    async def connection(self, *, to_watch: bool = False) -> UpstreamConnection:
        """The open connection with the fewest calls, or a new one (HostUnreachable when it cannot be had).
        ``to_watch``: one that may watch another user (past the pool's bound if every one watches its most)."""
        self.connections = [conn for conn in self.connections if not conn.closed]
        if to_watch:
            room = [conn for conn in self.connections if conn.watching < WATCHES_PER_CONNECTION]
            least = min(room, key=lambda conn: len(conn.ids), default=None)
            if least is not None:
                return least
        else:
            least = min(self.connections, key=lambda conn: len(conn.ids), default=None)
            if least is not None and (len(least.ids) < GROW_AT or len(self.connections) >= MAX_CONNECTIONS):
                return least
        if self._dialing is None:
            self._dialing = asyncio.get_running_loop().create_task(self._open())
        dialing = self._dialing
        try:
            return await asyncio.shield(dialing)  # a caller that leaves does not stop the dial others wait for
        finally:
            if dialing.done() and self._dialing is dialing:
                self._dialing = None

    async def _open(self) -> UpstreamConnection:
        try:
            _, writer = await asyncio.wait_for(self._dial(self.node, self.address), DIAL_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError, DaemonUnreachable) as exc:
            why = str(exc) or f"no answer within {DIAL_TIMEOUT_S:g} s"
            log.warning("router_host_unreachable", node=self.node, address=self.address, error=why,
                        budget=source("host", self.node))
            raise HostUnreachable(f"host {self.node} at {self.address} cannot be reached ({why}); nothing ran. "
                                  "Check that it runs and listens, then call again.") from None
        conn = UpstreamConnection(self.node, writer, self._on_notification, self._on_lost)
        self.connections.append(conn)
        return conn

    async def call(self, method: str, params: Any, *, on_progress: OnProgress | None = None,
                   client_token: Any = None, rewrite: Callable[[Any, int], Any] | None = None,
                   sent: Callable[[UpstreamConnection, int], None] | None = None,
                   timeout_s: float | None = None, on: UpstreamConnection | None = None,
                   verbatim: bool = False) -> dict[str, Any] | Verbatim:
        """Send one request and wait for its answer (the host's message, ids still the router's; ``verbatim``:
        a success answer comes as ``Verbatim``, its result unparsed).

        ``sent(conn, id)`` is told where it went, for a cancel to follow it. A caller that leaves
        (cancelled, or past ``timeout_s``) has the request cancelled on the host and its slot freed. ``on``: the
        connection to use (the pool's choice otherwise)."""
        conn = on or await self.connection()
        slot = Slot(on_progress, client_token, verbatim, waiter=asyncio.get_running_loop().create_future())
        upstream_id = conn.send(method, params, slot, rewrite)
        if sent is not None:
            sent(conn, upstream_id)
        # A timer, not asyncio.wait_for: that wraps every call's wait in one more future and callback.
        timer = None if timeout_s is None else asyncio.get_running_loop().call_later(timeout_s, _expire, slot.waiter)
        try:
            return await slot.waiter
        except (asyncio.CancelledError, asyncio.TimeoutError):
            conn.cancel(upstream_id, "the router's caller left")
            raise
        finally:
            if timer is not None:
                timer.cancel()
            conn.ids.close(upstream_id)

    def close(self) -> None:
        for conn in self.connections:
            conn.close()
        self.connections = []
