"""The daemon's side of the shim protocol (docs/shim.md), for any byte transport.

A backend feeds the shim's stdout into ``feed`` and gives a ``write`` function
for its stdin. Everything the shim says is untrusted: a line that is not the
protocol or is too long breaks the sandbox (``SandboxFailed``), and an answer or
progress for a call that is not the running one is dropped.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
from typing import Any, Callable

from sandboxd import strictjson
from sandboxd.errors import SandboxFailed
from sandboxd.logging import get_logger
from sandboxd.sandbox.backend import CallRequest, ProgressCallback

_log = get_logger("sandboxd.sandbox")

SHIM_PROTOCOL = 2


class ShimChannel:
    def __init__(self, write: Callable[[bytes], None], *, max_line_bytes: int) -> None:
        self._write = write
        self._max_line = max_line_bytes
        self._buffer = bytearray()
        self._ids = itertools.count(1)
        self._call_id: int | None = None
        self._call_future: asyncio.Future[dict[str, Any]] | None = None
        self._on_progress: ProgressCallback | None = None
        self._loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        self.closed: SandboxFailed | None = None

    # -- daemon → shim -----------------------------------------------------

    def call(self, request: CallRequest, on_progress: ProgressCallback) -> asyncio.Future[dict[str, Any]]:
        future: asyncio.Future[dict[str, Any]] = self._loop.create_future()
        if self.closed is not None:
            future.set_exception(self.closed)
            return future
        if self._call_future is not None and not self._call_future.done():
            # The pool hands a sandbox to one call at a time; this is a daemon bug.
            raise RuntimeError("sandbox already has a call in flight")
        self._call_id = next(self._ids)
        self._call_future = future
        self._on_progress = on_progress
        self._send({"jsonrpc": "2.0", "id": self._call_id, "method": "call", "params": request.to_params()})
        return future

    def cancel(self, reason: str) -> None:
        if self._call_future is not None and not self._call_future.done() and self.closed is None:
            self._send({"jsonrpc": "2.0", "method": "cancel", "params": {"id": self._call_id, "reason": reason}})

    def shutdown(self) -> None:
        if self.closed is None:
            self._send({"jsonrpc": "2.0", "method": "shutdown"})

    def _send(self, message: dict[str, Any]) -> None:
        self._write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    # -- shim → daemon -----------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Bytes from the shim's protocol stream; split on \\n only."""
        if self.closed is not None:
            return
        self._buffer += data
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end < 0:
                break
            self._handle_line(bytes(self._buffer[start:end]))
            start = end + 1
            if self.closed is not None:
                return
        del self._buffer[:start]
        if len(self._buffer) > self._max_line:
            self.close(SandboxFailed(f"the tool's output line exceeded {self._max_line} bytes; its sandbox was stopped."))

    def _handle_line(self, line: bytes) -> None:
        line = line.rstrip(b"\r")
        if not line:
            return
        try:
            message = strictjson.loads(line)
        except (ValueError, RecursionError):
            self.close(SandboxFailed("the sandbox wrote something that is not the shim protocol on its protocol stream."))
            return
        if not isinstance(message, dict):
            self.close(SandboxFailed("the sandbox sent a protocol message that is not an object."))
            return
        method = message.get("method")
        params = message.get("params")
        if not isinstance(params, dict):
            params = {}
        if method == "progress":
            if params.get("id") == self._call_id and self._on_progress is not None and not self._done():
                content = params.get("content")
                self._on_progress(content if isinstance(content, list) else [])
        elif method == "ready":
            if not self.ready.done():
                self.ready.set_result(params)
        elif "id" in message and ("result" in message or "error" in message):
            self._settle(message)
        # Anything else (future notifications, logs) is ignored on purpose.

    def _done(self) -> bool:
        return self._call_future is None or self._call_future.done()

    def _settle(self, message: dict[str, Any]) -> None:
        if message.get("id") != self._call_id or self._call_future is None:
            return  # an answer for a call we already gave up on
        future, self._call_future, self._on_progress = self._call_future, None, None
        if future.done():
            return
        if "error" in message:
            error = message.get("error") or {}
            text = error.get("message") if isinstance(error, dict) else str(error)
            future.set_exception(SandboxFailed(f"the shim refused the call: {text}"))
            return
        result = message.get("result")
        if not isinstance(result, dict):
            future.set_exception(SandboxFailed("the shim answered with a result that is not an object."))
            return
        future.set_result(result)

    def close(self, error: SandboxFailed) -> None:
        """The transport ended or broke the protocol: fail whatever waits on it."""
        if self.closed is not None:
            return
        self.closed = error
        if not self.ready.done():
            self.ready.set_exception(error)
            self.ready.exception()  # mark retrieved: a start that failed elsewhere must not warn
        if self._call_future is not None and not self._call_future.done():
            self._call_future.set_exception(error)
        self._call_future = None


class ShimSandbox:
    """What every shim-backed sandbox shares: the channel, a stderr tail, exit handling.

    Subclasses provide ``_write`` (bytes to the shim's stdin) and ``exit_reason``
    (why the sandbox ended, in words an agent can act on).
    """

    STDERR_TAIL_LINES = 20

    def __init__(self, sandbox_id: str, user: str, max_line_bytes: int) -> None:
        self.id = sandbox_id
        self.user = user
        self.channel = ShimChannel(self._write, max_line_bytes=max_line_bytes)
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=self.STDERR_TAIL_LINES)
        self.destroying = False
        self._exited = False
        self._exit_callbacks: list[Callable[[], None]] = []
        self._stderr_partial = b""
        # Called with each line of tool output as it arrives (`sandboxd run` shows them to the developer).
        self.on_stderr: Callable[[str], None] | None = None

    @property
    def alive(self) -> bool:
        return not self._exited and self.channel.closed is None

    def call(self, request: CallRequest, on_progress: ProgressCallback) -> asyncio.Future[dict[str, Any]]:
        self.stderr_tail.clear()
        return self.channel.call(request, on_progress)

    def cancel(self, reason: str) -> None:
        self.channel.cancel(reason)

    def on_exit(self, callback: Callable[[], None]) -> None:
        self._exit_callbacks.append(callback)

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    async def exit_reason(self) -> SandboxFailed:
        raise NotImplementedError

    def stderr_data(self, payload: bytes) -> None:
        """Tool output (tagged with its call id by the shim): kept as a tail for crash reports."""
        lines = (self._stderr_partial + payload).split(b"\n")
        self._stderr_partial = lines.pop()[-4096:]
        for raw in lines:
            line = raw[:4096].decode("utf-8", "replace")
            self.stderr_tail.append(line)
            _log.debug("tool_stderr", sandbox=self.id, line=line)
            if self.on_stderr is not None:
                self.on_stderr(line)

    def transport_closed(self) -> None:
        """The shim's stream ended: the sandbox exited, or sandboxd destroyed it."""
        if self._exited:
            return
        self._exited = True
        if self.destroying:
            self.channel.close(SandboxFailed("the sandbox was stopped by sandboxd."))
            return
        asyncio.get_running_loop().create_task(self._report_exit())

    async def _report_exit(self) -> None:
        self.channel.close(await self.exit_reason())
        for callback in self._exit_callbacks:
            callback()
