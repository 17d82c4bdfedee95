"""MCP over this process's stdin and stdout, bounded against a hostile or broken host.

The SDK's own stdio transport reads lines of any length and answers nothing to a line
that is not JSON-RPC; this one frames with our LineBuffer, so:

- a line longer than ``max_line`` is dropped up to its newline and answered -32600;
- a line that is not JSON is answered -32700, JSON that is not a JSON-RPC message -32600
  (with its id when it had a usable one), as is an object with a key twice (never run);
  the stream goes on either way;
- at most ``max_in_flight`` requests are in flight: past that stdin is not read until one
  is answered (or cancelled), so a host that sends without reading its answers stalls
  itself, not this process's memory;
- stdout is written with flow control: a host that stops reading blocks the writer.

While serving, fd 0 is /dev/null and fd 1 is stderr (what the SDK's transport does too):
nothing printed by mistake can corrupt the protocol stream.
"""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import anyio
import mcp_types as types
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp.shared.message import SessionMessage

from sandboxd.lines import LineBuffer
from sandboxd.mcp.strict import duplicate_key_error
from sandboxd.wire import INVALID_REQUEST, PARSE_ERROR, ErrorResponse, error_object, error_response


class _Writer(asyncio.Protocol):
    """The write end of a pipe, with flow control: ``drained`` waits while the reader is behind."""

    def __init__(self) -> None:
        self._can_write = asyncio.Event()
        self._can_write.set()
        self.closed = asyncio.Event()

    def pause_writing(self) -> None:
        self._can_write.clear()

    def resume_writing(self) -> None:
        self._can_write.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self._can_write.set()
        self.closed.set()

    async def drained(self) -> None:
        await self._can_write.wait()


class InFlight:
    """Request ids read but not yet answered; reading waits while there are ``limit`` of them."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._ids: set[Any] = set()
        self._room = asyncio.Event()
        self._room.set()

    def add(self, request_id: Any) -> None:
        self._ids.add(_key(request_id))
        if len(self._ids) >= self.limit:
            self._room.clear()

    def done(self, request_id: Any) -> None:
        self._ids.discard(_key(request_id))
        if len(self._ids) < self.limit:
            self._room.set()

    async def room(self) -> None:
        await self._room.wait()


def _key(request_id: Any) -> Any:
    return ("s", request_id) if isinstance(request_id, str) else ("n", request_id)


def decode(line: bytes) -> types.JSONRPCMessage | ErrorResponse:
    """The message on ``line``, or the JSON-RPC error that answers it when it is not one."""
    refused = duplicate_key_error(line)
    if refused is not None:
        return refused
    try:
        parsed = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
        # A request whose id is no id would pass as a notification, and go unanswered.
        if not isinstance(parsed, types.JSONRPCNotification) or b'"id"' not in line or "id" not in json.loads(line):
            return parsed
    except ValueError:
        pass
    try:
        message = json.loads(line)
    except (ValueError, RecursionError):
        return _error(None, PARSE_ERROR, "the line is not JSON; send one JSON-RPC 2.0 message per line.")
    request_id = message.get("id") if isinstance(message, dict) else None
    if isinstance(request_id, bool) or not isinstance(request_id, (str, int)):
        request_id = None
    return _error(request_id, INVALID_REQUEST, "not a JSON-RPC 2.0 message MCP knows (a request needs "
                                               "\"jsonrpc\": \"2.0\", an id and a \"method\" string); "
                                               "batches are not accepted.")


def _error(request_id: Any, code: int, message: str) -> ErrorResponse:
    return error_response(request_id, error_object(code, message))


@asynccontextmanager
async def stdio_streams(*, max_line: int, max_in_flight: int = 64) -> AsyncIterator[
        tuple[MemoryObjectReceiveStream[SessionMessage | Exception], MemoryObjectSendStream[SessionMessage]]]:
    """(read stream, write stream) for ``Server.run``, over fds 0 and 1."""
    loop = asyncio.get_running_loop()
    stdin_fd, stdout_fd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(stdin_fd, "rb", 0))
    out, writer = await loop.connect_write_pipe(_Writer, os.fdopen(stdout_fd, "wb", 0))
    in_flight = InFlight(max_in_flight)

    async def write(message: ErrorResponse | types.JSONRPCMessage) -> None:
        if writer.closed.is_set():
            return
        if isinstance(message, dict):
            data = json.dumps(message, separators=(",", ":"))
        else:
            data = message.model_dump_json(by_alias=True, exclude_unset=True)
        out.write(data.encode() + b"\n")
        await writer.drained()

    to_server, from_host = anyio.create_memory_object_stream[SessionMessage | Exception](0)
    to_host, from_server = anyio.create_memory_object_stream[SessionMessage](0)

    async def read_stdin() -> None:
        lines = LineBuffer(max_line)
        async with to_server:
            while chunk := await reader.read(1 << 16):
                for line in lines.feed(chunk):
                    if not isinstance(line, bytes):
                        await write(_error(None, INVALID_REQUEST, f"message longer than {max_line} bytes; it was "
                                                                  "skipped (limit: max_message_bytes)."))
                        continue
                    message = decode(line)
                    if isinstance(message, dict):
                        await write(message)
                        continue
                    if isinstance(message, types.JSONRPCRequest):
                        await in_flight.room()
                        in_flight.add(message.id)
                    elif isinstance(message, types.JSONRPCNotification) and message.method == "notifications/cancelled":
                        in_flight.done((message.params or {}).get("requestId"))  # a cancelled request is not answered
                    await to_server.send(SessionMessage(message))

    async def write_stdout() -> None:
        async with from_server:
            async for session_message in from_server:
                message = session_message.message
                if isinstance(message, (types.JSONRPCResponse, types.JSONRPCError)):
                    in_flight.done(message.id)
                await write(message)

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(read_stdin)
            tasks.start_soon(write_stdout)
            yield from_host, to_host
            tasks.cancel_scope.cancel()
    finally:
        out.close()
