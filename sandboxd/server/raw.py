"""Raw bytes on a connection of their own: how ``users/export`` and ``users/import`` move a user (docs/protocol.md).

A raw method's request must be the first line on a fresh connection, with nothing in flight.
From then on the connection's bytes are no longer JSON lines:

- export: the daemon answers one JSON line (the result), then writes the archive until it
  closes the connection; the archive's own end marker tells a whole one from a cut one;
- import: the client sends the archive after its request line, then half-closes; the daemon
  answers one JSON line once the archive is checked and in place (or refused), and closes.

``RawChannel`` is the connection's end for the method's work: ``read`` for a worker thread
(back-pressure: reading pauses while ``HIGH_WATER`` bytes wait), ``write`` for the loop
(it waits while the client reads no more), ``answer`` and ``fail`` for the one JSON line.
"""

from __future__ import annotations

import asyncio
import queue
from typing import Any, Callable, Coroutine, NamedTuple

from sandboxd.wire import Message, error_response, response

HIGH_WATER = 4 << 20  # bytes received and not yet read by the worker: reading pauses past this
_LOST = object()  # the connection went away before its end


class Raw(NamedTuple):
    """A raw method's answer: ``work(channel)`` runs with the connection's bytes; it answers through the channel."""

    work: Callable[[RawChannel], Coroutine[Any, Any, None]]


class RawChannel:
    def __init__(self, request_id: Any, send: Callable[[Message], None], pause_reading: Callable[[], None],
                 resume_reading: Callable[[], None], write: Callable[[bytes], None], close: Callable[[], None]) -> None:
        self.request_id = request_id
        self._send, self._pause, self._resume, self._write, self._close = (send, pause_reading, resume_reading,
                                                                             write, close)
        self._incoming: queue.SimpleQueue[bytes | object] = queue.SimpleQueue()
        self._waiting = 0  # bytes in _incoming
        self._reading_paused = False
        self._rest = b""  # of the chunk the worker took last
        self._writable = asyncio.Event()
        self._writable.set()
        self.cancelled = False
        self.answered = False
        self._loop = asyncio.get_running_loop()

    # -- from the connection (the loop) ---------------------------------------------

    def received(self, data: bytes) -> None:
        if not data:
            return
        self._waiting += len(data)
        self._incoming.put(data)
        if self._waiting > HIGH_WATER and not self._reading_paused:
            self._reading_paused = True
            self._pause()

    def ended(self) -> None:
        """The client half-closed: what it sent is all."""
        self._incoming.put(b"")

    def cancel(self, _reason: str) -> None:
        """The connection went away (``InFlight``): a worker's read fails, and writes stop."""
        self.cancelled = True
        self._incoming.put(_LOST)
        self._writable.set()

    def pause(self) -> None:
        self._writable.clear()

    def resume(self) -> None:
        self._writable.set()

    # -- for the method's work ----------------------------------------------------------

    def read(self, n: int) -> bytes:
        """At most ``n`` bytes the client sent, b"" at its half-close (blocking: a worker thread's).
        ConnectionError when the connection went away first."""
        if not self._rest:
            chunk = self._incoming.get()
            if chunk is _LOST:
                self._incoming.put(_LOST)  # every later read fails too
                raise ConnectionError("the client went away before the end of the archive")
            assert isinstance(chunk, bytes)
            if not chunk:
                self._incoming.put(b"")
                return b""
            self._rest = chunk
            self._loop.call_soon_threadsafe(self._taken, len(chunk))
        piece, self._rest = self._rest[:n], self._rest[n:]
        return piece

    def _taken(self, n: int) -> None:
        self._waiting -= n
        if self._reading_paused and self._waiting <= HIGH_WATER // 2:
            self._reading_paused = False
            self._resume()

    async def write(self, data: bytes) -> None:
        """Write raw bytes, waiting while the client reads no more. ConnectionError once it went away."""
        await self._writable.wait()
        if self.cancelled:
            raise ConnectionError("the client went away")
        self._write(data)

    def answer(self, result: dict[str, Any]) -> None:
        self.answered = True
        self._send(response(self.request_id, result))

    def fail(self, error: Any) -> None:
        """The one error line (``error`` as rpc.error_body makes it), when nothing was answered yet."""
        if not self.answered:
            self.answered = True
            self._send(error_response(self.request_id, error))

    def close(self) -> None:
        self._close()
