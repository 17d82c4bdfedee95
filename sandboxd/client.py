"""A small blocking client of the daemon's socket, for the CLI and tests."""

from __future__ import annotations

import collections
import itertools
import socket
from pathlib import Path
from typing import Any, Callable, Mapping

from sandboxd import strictjson
from sandboxd.lines import LineBuffer
from sandboxd.wire import RpcError as RpcError  # where the CLI and the tests have always found it
from sandboxd.wire import RequestId, cancelled, request


class DaemonUnreachable(Exception):
    pass


class Client:
    def __init__(self, path: Path | str, timeout: float | None = None) -> None:
        self.path = str(path)
        self._ids = itertools.count(1)
        self._lines = LineBuffer()  # no limit: the daemon is not the party to defend against
        self._pending: collections.deque[bytes] = collections.deque()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            self._sock.close()
            raise DaemonUnreachable(
                f"no sandboxd is listening on {self.path} ({exc.strerror}); start it with `sandboxd serve` or pass --socket."
            ) from None
        except PermissionError:
            self._sock.close()
            raise DaemonUnreachable(
                f"permission denied on {self.path}; join the socket's group or run as its owner."
            ) from None

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # a thread blocked reading this connection wakes (close alone does not)
        except OSError:
            pass  # never connected, or the daemon closed first
        self._sock.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def send(self, message: Mapping[str, Any]) -> None:
        self._sock.sendall(strictjson.dumps_line(message))

    def read_message(self) -> dict[str, Any]:
        while not self._pending:
            try:
                chunk = self._sock.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""  # closed with our request unread (e.g. a refused peer): same as a close
            if not chunk:
                raise DaemonUnreachable("sandboxd closed the connection.")
            self._pending.extend(line for line in self._lines.feed(chunk) if isinstance(line, bytes))
        message: dict[str, Any] = strictjson.loads_line(self._pending.popleft())
        return message

    def request(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
        on_interrupt: Callable[[Any], None] | None = None,
    ) -> Any:
        """Send one request and wait for its answer, passing progress notifications on.

        Ctrl-C while waiting calls ``on_interrupt(request_id)`` (e.g. to cancel) and keeps
        waiting for the answer; a second Ctrl-C propagates.
        """
        request_id = next(self._ids)
        self.send(request(request_id, method, params))
        interrupted = False
        while True:
            # Ctrl-C may land anywhere in the wait, printing progress included (the moment a
            # user sees the tool run), not only in recv: all of it is one interruptible wait.
            try:
                reply = self._reply_to(request_id, on_progress)
            except KeyboardInterrupt:
                if interrupted or on_interrupt is None:
                    raise
                interrupted = True
                on_interrupt(request_id)
                continue
            if "error" in reply:
                raise RpcError.from_error(reply["error"])
            return reply.get("result")

    def _reply_to(self, request_id: int, on_progress: Callable[[dict[str, Any]], None] | None) -> dict[str, Any]:
        while True:
            reply = self.read_message()
            if reply.get("method") == "notifications/progress":
                if on_progress is not None:
                    on_progress(reply.get("params") or {})
                continue
            # An error with id null could not be tied to a request (a refused connection,
            # an unparsable line); the request we are waiting on is the one that failed.
            if reply.get("id") == request_id or ("error" in reply and reply.get("id") is None):
                return reply

    def cancel(self, request_id: RequestId, reason: str = "cancelled by the user") -> None:
        self.send(cancelled(request_id, reason))

    def call_tool(self, user: str, name: str, arguments: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return self.request("tools/call", {"user": user, "name": name, "arguments": arguments, **extra})
