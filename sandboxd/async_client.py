"""A small asyncio client of the daemon's socket: many requests in flight on one connection.

For long-lived clients that relay calls (`sandboxd mcp`); the CLI uses the blocking
``sandboxd.client.Client``. Answers are matched by id; progress notifications go to the
request they belong to (the daemon uses the request id as the token, as we send none);
every other notification goes to ``on_notification``. When the daemon closes the
connection, every request in flight fails with ``ConnectionLost`` and the client stays
closed: the owner connects again.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any, Callable

from sandboxd import strictjson
from sandboxd.client import DaemonUnreachable
from sandboxd.lines import LineBuffer
from sandboxd.wire import PROGRESS, Message, RpcError, cancelled, notification, request

Progress = Callable[[dict[str, Any]], None]
Notification = Callable[[str, dict[str, Any]], None]


class ConnectionLost(DaemonUnreachable):
    """The daemon closed the connection (it stopped or restarted) with requests in flight."""


class AsyncClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 on_notification: Notification | None) -> None:
        self._reader, self._writer = reader, writer
        self._on_notification = on_notification
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[asyncio.Future[Any], Progress | None]] = {}
        self._lines = LineBuffer()  # no limit: the daemon is not the party to defend against
        self.closed = asyncio.Event()
        self._reading = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, path: Path | str, on_notification: Notification | None = None) -> AsyncClient:
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise DaemonUnreachable(f"no sandboxd is listening on {path} ({exc.strerror}); start it with "
                                    "`sandboxd serve` or pass --socket.") from None
        except PermissionError:
            raise DaemonUnreachable(f"permission denied on {path}; join the socket's group or run as its owner.") from None
        except OSError as exc:
            raise DaemonUnreachable(f"cannot connect to {path}: {exc.strerror or exc}.") from None
        return cls(reader, writer, on_notification)

    async def request(self, method: str, params: dict[str, Any] | None = None, *,
                      on_progress: Progress | None = None) -> tuple[int, asyncio.Future[Any]]:
        """Send a request; its id and the future of its result (RpcError or ConnectionLost when it fails)."""
        if self.closed.is_set():
            raise ConnectionLost("sandboxd closed the connection.")
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (future, on_progress)
        self._send(request(request_id, method, params))
        try:
            await self._writer.drain()
        except (ConnectionError, OSError):
            self._lost()  # fails the future with ConnectionLost
        return request_id, future

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """request(), then wait for the result."""
        _, future = await self.request(method, params)
        return await future

    def notify(self, method: str, params: dict[str, Any]) -> None:
        if not self.closed.is_set():
            self._send(notification(method, params))

    def cancel(self, request_id: int, reason: str) -> None:
        """notifications/cancelled for ``request_id``: the daemon stops it (its tool's AbortSignal fires)."""
        if not self.closed.is_set():
            self._send(cancelled(request_id, reason))

    def forget(self, request_id: int) -> None:
        """Stop waiting for ``request_id`` (its answer, when it comes, is dropped)."""
        self._pending.pop(request_id, None)

    async def close(self) -> None:
        self._writer.close()
        self._reading.cancel()
        try:
            await self._reading
        except asyncio.CancelledError:
            pass
        self._lost()

    def _send(self, message: Message) -> None:
        self._writer.write(strictjson.dumps_line(message))

    async def _read(self) -> None:
        try:
            while chunk := await self._reader.read(1 << 16):
                for line in self._lines.feed(chunk):
                    if isinstance(line, bytes):
                        self._handle(strictjson.loads_line(line))
        except (ConnectionError, OSError):
            pass
        finally:
            self._lost()

    def _handle(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        if method is None and "error" in message and message.get("id") is None:
            # Tied to no request (a refused peer, a line the daemon could not read): every request waiting fails.
            pending, self._pending = self._pending, {}
            for future, _ in pending.values():
                if not future.done():
                    future.set_exception(RpcError.from_error(message["error"]))
            return
        if method is None:
            entry = self._pending.pop(message.get("id"), None)  # type: ignore[arg-type]
            if entry is None or entry[0].done():
                return
            if "error" in message:
                entry[0].set_exception(RpcError.from_error(message["error"]))
            else:
                entry[0].set_result(message.get("result"))
            return
        params = message.get("params") or {}
        if method == PROGRESS:
            entry = self._pending.get(params.get("progressToken"))  # type: ignore[arg-type]
            if entry is not None and entry[1] is not None:
                entry[1](params)
        elif self._on_notification is not None:
            self._on_notification(method, params)

    def _lost(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        pending, self._pending = self._pending, {}
        for future, _ in pending.values():
            if not future.done():
                future.set_exception(ConnectionLost(
                    "sandboxd closed the connection (it stopped or restarted) before answering; the next call "
                    "connects again."))
                future.exception()  # retrieved: a request nobody awaits any more is not an error to log
