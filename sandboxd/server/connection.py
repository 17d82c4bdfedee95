"""One client connection: bytes in and out, and what the daemon lends it (``Edge``).

Lines are framed by ``LineBuffer`` (an over-long line is answered with -32600 and
skipped), each goes to the JSON-RPC ``Dispatcher``, the connection's calls in flight
are its ``ConnectionCalls``. A problem with one message never closes the connection.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Mapping, Protocol

from sandboxd.errors import PeerRefused
from sandboxd.lines import LineBuffer
from sandboxd.server.calls import Calls, ConnectionCalls
from sandboxd.server.rpc import INVALID_REQUEST, Dispatcher, Method, encode, error_body

# Stop reading from a client whose responses pile up unread.
_WRITE_HIGH_WATER = 8 << 20


class Edge(Protocol):
    """What a connection may use of the daemon."""

    calls: Calls

    @property
    def max_message_bytes(self) -> int: ...

    def refusal(self, sock: socket.socket) -> str | None:
        """Why the peer on ``sock`` may not connect (allowed_uids/allowed_gids), or None."""

    def opened(self, connection: Connection) -> None: ...

    def closed(self, connection: Connection) -> None: ...

    def methods(self, calls: ConnectionCalls) -> Mapping[str, Method]:
        """The JSON-RPC methods of a connection whose calls are ``calls``."""


class Connection(asyncio.Protocol):
    def __init__(self, edge: Edge) -> None:
        self._edge = edge
        self.transport: asyncio.Transport | None = None
        self._lines = LineBuffer(edge.max_message_bytes)
        self.calls = ConnectionCalls(edge.calls, self.send)
        self._rpc = Dispatcher(self.send, edge.methods(self.calls), {"notifications/cancelled": self.calls.cancel})
        self.closed = False

    # -- asyncio.Protocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        refusal = self._edge.refusal(transport.get_extra_info("socket"))
        if refusal is not None:
            # One error line, then the door: a refused peer never reaches dispatch.
            self.closed = True
            self.transport.write(encode({"jsonrpc": "2.0", "id": None, "error": error_body(PeerRefused(refusal))}))
            self.transport.close()
            return
        self.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self._edge.opened(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._edge.closed(self)
        self.calls.client_gone()

    def pause_writing(self) -> None:
        # The client reads no more: stop reading its requests and its calls' sandboxes,
        # so that their output waits in the sandbox, not in our write buffer.
        if self.transport is not None:
            self.transport.pause_reading()
        self.calls.pause()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()
        self.calls.resume()

    def data_received(self, data: bytes) -> None:
        for line in self._lines.feed(data):
            if isinstance(line, bytes):
                self._rpc.handle_line(line)
            else:  # over the limit, and skipped
                self.send({"jsonrpc": "2.0", "id": None, "error": {"code": INVALID_REQUEST, "message": (
                    f"message longer than {self._lines.max_line} bytes; it was skipped. "
                    "Send smaller messages (limit: max_message_bytes).")}})

    def eof_received(self) -> bool:
        # A unix socket cannot tell a half-close from a close: EOF is a disconnect,
        # which cancels the calls in flight (connection_lost follows).
        return False

    def send(self, message: dict[str, Any]) -> None:
        if not self.closed and self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode(message))
