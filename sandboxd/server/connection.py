"""One client connection: bytes in and out, and what the daemon lends it (``Edge``).

Lines are framed by ``LineBuffer`` (an over-long line is answered with -32600 and
skipped), each goes to the JSON-RPC ``Dispatcher``, which owns the connection's requests
in flight: the disconnect and the client's back-pressure reach them through it. A
problem with one message never closes the connection.

The loop is every client's and every sandbox's: a connection handles at most
``LINES_PER_TURN`` lines before the loop's other work gets its turn (a client pipelining
thousands of requests in one write would otherwise hold it for their whole time), and a
refused peer is answered after ``RefusedPeers.DELAY_S``, so a client retrying in a loop
costs a few accepts a second, not thousands.

A raw method (``users/export``, ``users/import``) asked as a connection's first line takes
the connection's bytes over from then on (server/raw.py); its client's EOF ends its archive.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Mapping, Protocol, cast

from sandboxd.errors import InvalidParams, PeerRefused
from sandboxd.lines import LineBuffer
from sandboxd.server.raw import Raw, RawChannel
from sandboxd.server.rpc import Dispatcher, Later, Method, error_body
from sandboxd.wire import INVALID_REQUEST, Message, encode, error_object, error_response

# Stop reading from a client whose responses pile up unread.
_WRITE_HIGH_WATER = 8 << 20
# Lines one connection handles in one go; the rest wait in its buffer (and its reading pauses).
LINES_PER_TURN = 64


class RefusedPeers:
    """Answers peers that allowed_uids/allowed_gids refuse: one error line after ``DELAY_S``, our end of the
    connection shut, what the peer sent read and dropped until it closes (closing over unread
    bytes would reset the connection, and the peer would lose the answer), at most ``LINGER_S``.

    At most ``MAX_HELD`` wait at once (each holds an fd); past that, answered at once."""

    DELAY_S = 0.5
    LINGER_S = 2.0
    MAX_HELD = 256

    def __init__(self) -> None:
        self.held = 0

    def refuse(self, transport: asyncio.Transport, message: bytes) -> None:
        if self.held >= self.MAX_HELD:
            return self._answer(transport, message)
        self.held += 1
        transport.pause_reading()  # nothing it sends is read meanwhile

        def answer() -> None:
            self.held -= 1
            self._answer(transport, message)

        asyncio.get_running_loop().call_later(self.DELAY_S, answer)

    def _answer(self, transport: asyncio.Transport, message: bytes) -> None:
        if transport.is_closing():
            return
        transport.write(message)
        if transport.can_write_eof():
            transport.write_eof()
        transport.resume_reading()  # the connection drops what it reads, and closes at the peer's EOF
        asyncio.get_running_loop().call_later(self.LINGER_S, transport.close)


class Edge(Protocol):
    """What a connection may use of the daemon."""

    refused_peers: RefusedPeers

    @property
    def max_message_bytes(self) -> int: ...

    def refusal(self, sock: socket.socket) -> str | None:
        """Why the peer on ``sock`` may not connect (allowed_uids/allowed_gids), or None."""

    def opened(self, connection: Connection) -> None: ...

    def closed(self, connection: Connection) -> None: ...

    def methods(self, connection: Connection) -> Mapping[str, Method]:
        """The JSON-RPC methods of ``connection`` (they answer through ``connection.send``)."""


class Connection(asyncio.Protocol):
    """``peer_uid``: whose share of the descriptors it counts against (the edge releases it once closed);
    ``refusal``: why it is refused before it is served (past that share), besides what the edge says."""

    def __init__(self, edge: Edge, *, peer_uid: int | None = None, refusal: str | None = None) -> None:
        self._edge = edge
        self.peer_uid = peer_uid
        self.refusal = refusal
        self.transport: asyncio.Transport | None = None
        self._lines = LineBuffer(edge.max_message_bytes)
        self._rpc = Dispatcher(self.send, edge.methods(self), self._go_raw)
        self._lines_handled = 0
        self._raw: RawChannel | None = None  # a raw method's (server/raw.py): it takes every byte from then on
        self.closed = False
        self._refused = False  # by the edge: what it sends is dropped (RefusedPeers)
        self._paused: set[str] = set()  # why reading is paused: "writing" (the client reads no more), "turn"
        self._next_turn: asyncio.Handle | None = None

    # -- asyncio.Protocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream socket's (uvloop's transports are not asyncio.Transport subclasses, only alike).
        self.transport = cast(asyncio.Transport, transport)
        refusal = self.refusal or self._edge.refusal(self.transport.get_extra_info("socket"))
        if refusal is not None:
            # One error line (RefusedPeers), then closed: a refused peer never reaches dispatch.
            self.closed = self._refused = True
            self._edge.refused_peers.refuse(
                self.transport, encode(error_response(None, error_body(PeerRefused(refusal)))))
            return
        self.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self._edge.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._next_turn is not None:
            self._next_turn.cancel()
        self._edge.closed(self)
        self._rpc.disconnected()

    def pause_writing(self) -> None:
        # The client reads no more: stop reading its requests and its calls' sandboxes,
        # so that their output waits in the sandbox, not in our write buffer.
        self._pause("writing")
        self._rpc.pause()

    def resume_writing(self) -> None:
        self._resume("writing")
        self._rpc.resume()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read only so that the close does not reset the peer's answer
        if self._raw is not None:
            return self._raw.received(data)
        self._handle(data)

    def _handle(self, data: bytes = b"") -> None:
        """Handle the lines ``data`` completes, LINES_PER_TURN at most; the rest at the loop's next turn."""
        self._next_turn = None
        lines = self._lines.feed(data)
        try:
            for handled, line in enumerate(lines, 1):
                self._lines_handled += 1
                if isinstance(line, bytes):
                    self._rpc.handle_line(line)
                    if self._raw is not None:
                        break  # the bytes after its request line are the raw method's (below)
                else:  # over the limit, and skipped
                    self.send(error_response(None, error_object(INVALID_REQUEST, (
                        f"message longer than {self._lines.max_line} bytes; it was skipped. "
                        "Send smaller messages (limit: max_message_bytes)."))))
                if handled >= LINES_PER_TURN and not self.closed:
                    # The rest stays in the buffer; reading waits until it is handled.
                    self._pause("turn")
                    self._next_turn = asyncio.get_running_loop().call_soon(self._handle)
                    return
        finally:
            lines.close()  # what was not handled stays in the buffer for the next turn
        if self._raw is not None:
            return self._raw.received(self._lines.take_rest())
        if self._paused:  # (nearly never: asked here, it spares every message a call)
            self._resume("turn")

    def _pause(self, reason: str) -> None:
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
        self._paused.add(reason)

    def _resume(self, reason: str) -> None:
        if reason not in self._paused:
            return
        self._paused.discard(reason)
        if not self._paused and self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        # A unix socket cannot tell a half-close from a close: EOF is a disconnect,
        # which cancels the calls in flight (connection_lost follows). A refused peer's
        # connection stays for its answer, which RefusedPeers sends before closing it;
        # a raw method's too: its client's EOF ends the bytes it sends, not the connection.
        if self._raw is not None:
            self._raw.ended()
            return True
        return self._refused

    # -- raw methods (server/raw.py) ----------------------------------------------

    def _go_raw(self, request_id: Any, raw: Raw) -> Later:
        """Hand the connection's bytes to ``raw``'s work; InvalidParams unless its request is the connection's first."""
        if self._lines_handled != 1 or self._rpc.busy or self.transport is None:
            raise InvalidParams("this method moves raw bytes: it must be the first and only request on a connection "
                                "of its own. Open a new connection for it (sandboxd users export/import do).")
        transport = self.transport
        channel = self._raw = RawChannel(request_id, self.send, lambda: self._pause("raw"),
                                         lambda: self._resume("raw"), transport.write, transport.close)
        return Later(self._run_raw(raw, channel), channel)

    async def _run_raw(self, raw: Raw, channel: RawChannel) -> None:
        """The work, its failure told in the one JSON line when nothing was answered yet; the connection closed after."""
        try:
            await raw.work(channel)
        except Exception as exc:
            channel.fail(error_body(exc, "raw"))
        finally:
            channel.close()

    def send(self, message: Message) -> None:
        if not self.closed and self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode(message))
