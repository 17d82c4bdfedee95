"""One client connection: JSON-RPC 2.0 lines in, responses and notifications out.

Framing per PROTOCOL.md: split on \\n only, ignore a trailing \\r, answer an
over-long line with -32600 and skip it. Requests run concurrently and answer
in any order; a problem with one message never closes the connection.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any, Coroutine

from sandboxd import strictjson
from sandboxd.errors import InvalidParams, PeerRefused, SandboxdError
from sandboxd.logging import get_logger
from sandboxd.server.calls import CallContext, parse_call_params, result, text
from sandboxd.tools.discovery import ScanNeeded
from sandboxd.users import check_user

if TYPE_CHECKING:
    from sandboxd.server.server import Server

log = get_logger("sandboxd.server")

PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = -32700, -32600, -32601, -32602, -32603
# Stop reading from a client whose responses pile up unread.
_WRITE_HIGH_WATER = 8 << 20


def encode(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    try:
        return data.encode() + b"\n"
    except UnicodeEncodeError:  # lone surrogates from a tool's output: escape them
        return json.dumps(message, separators=(",", ":")).encode() + b"\n"


class Connection(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.max_line = server.config.max_message_bytes
        self._buffer = bytearray()
        self._skipping = False  # inside an over-long line, dropping bytes up to its \n
        self.calls: dict[Any, CallContext] = {}  # request id → call in flight
        self.closed = False
        self._answering: set[asyncio.Task[None]] = set()  # requests answered once a tools scan is done
        self.writing_paused = False  # our write buffer is past its high-water mark
        self._paused_sandboxes: set[Any] = set()  # sandboxes of our calls we stopped reading

    # -- asyncio.Protocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        refusal = self.server.peer_policy.refusal(transport.get_extra_info("socket"))
        if refusal is not None:
            # One error line, then the door: a refused peer never reaches dispatch.
            self.closed = True
            error = {"code": PeerRefused.code, "message": refusal}
            self.transport.write(encode({"jsonrpc": "2.0", "id": None, "error": error}))
            self.transport.close()
            return
        self.transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        # A client that goes away cancels every call it has in flight.
        for ctx in list(self.calls.values()):
            ctx.cancel("client disconnected")

    def pause_writing(self) -> None:
        # The client reads no more: stop reading its requests, and the sandboxes of its
        # running calls (a call that starts meanwhile is paused at its first progress),
        # so that their output waits in the sandbox, not in our write buffer.
        self.writing_paused = True
        if self.transport is not None:
            self.transport.pause_reading()
        for ctx in self.calls.values():
            self._pause_sandbox(ctx)

    def resume_writing(self) -> None:
        self.writing_paused = False
        if self.transport is not None:
            self.transport.resume_reading()
        for sandbox in self._paused_sandboxes:
            sandbox.resume_reading()
        self._paused_sandboxes.clear()

    def _pause_sandbox(self, ctx: CallContext) -> None:
        sandbox = ctx.sandbox
        if ctx.phase == "running" and sandbox is not None and sandbox not in self._paused_sandboxes:
            sandbox.pause_reading()
            self._paused_sandboxes.add(sandbox)

    def _call_ended(self, ctx: CallContext) -> None:
        """Before its sandbox goes back to the pool: another caller must find it reading."""
        if ctx.sandbox is not None and ctx.sandbox in self._paused_sandboxes:
            self._paused_sandboxes.discard(ctx.sandbox)
            ctx.sandbox.resume_reading()

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            if self._skipping:
                self._skipping = False
            elif end - start > self.max_line:
                self._too_long()
            else:
                self.handle_line(bytes(buffer[start:end]))
            start = end + 1
        del buffer[:start]
        if len(buffer) > self.max_line:
            if not self._skipping:
                self._skipping = True
                self._too_long()
            buffer.clear()

    def _too_long(self) -> None:
        self.send_error(None, INVALID_REQUEST, f"message longer than {self.max_line} bytes; it was skipped. "
                        "Send smaller messages (limit: max_message_bytes).")

    def eof_received(self) -> bool:
        # A unix socket cannot tell a half-close from a close: EOF is a disconnect,
        # which cancels the calls in flight (connection_lost follows).
        return False

    # -- messages ---------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        if not self.closed and self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode(message))

    def send_error(self, request_id: Any, code: int, message: str, data: Any = None) -> None:
        error: dict[str, Any] = {"code": code, "message": message}
        if data is not None:
            error["data"] = data
        self.send({"jsonrpc": "2.0", "id": request_id, "error": error})

    def handle_line(self, line: bytes) -> None:
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.strip():
            return
        try:
            message = strictjson.loads(line, unique_keys=True)
        except UnicodeDecodeError:
            return self.send_error(None, PARSE_ERROR, "message is not valid UTF-8; send UTF-8 JSON.")
        except strictjson.DuplicateKey as exc:
            # Which value would win is parser-dependent: refused, not guessed (PROTOCOL.md).
            return self.send_error(None, INVALID_REQUEST, f"{exc}; send every key of an object once.")
        except RecursionError:
            return self.send_error(None, PARSE_ERROR, "message is nested too deeply to parse.")
        except ValueError as exc:
            return self.send_error(None, PARSE_ERROR, f"message is not JSON: {exc}.")
        if isinstance(message, list):
            return self.send_error(None, INVALID_REQUEST, "batches are not supported; send one request per line.")
        if not isinstance(message, dict):
            return self.send_error(None, INVALID_REQUEST, "a message must be a JSON-RPC 2.0 object.")
        request_id = message.get("id")
        if not isinstance(request_id, (str, int, float, type(None))) or isinstance(request_id, bool):
            return self.send_error(None, INVALID_REQUEST, "'id' must be a string or a number.")
        if isinstance(request_id, int) and abs(request_id) > strictjson.MAX_DOUBLE_INT:
            # JavaScript reads it as Infinity: no client could match the answer to its request.
            return self.send_error(None, INVALID_REQUEST, "'id' is a number too large for a double; use a smaller number or a string.")
        method = message.get("method")
        if message.get("jsonrpc") != "2.0" or not isinstance(method, str):
            return self.send_error(request_id, INVALID_REQUEST, "not a JSON-RPC 2.0 request: it needs \"jsonrpc\": \"2.0\" and a \"method\" string.")
        params = message.get("params")
        if "id" not in message:
            return self.handle_notification(method, params)
        try:
            self.dispatch(request_id, method, params)
        except SandboxdError as exc:
            self.send_error(request_id, exc.code, exc.message, exc.data)
        except Exception:
            log.exception("request_failed", method=method)
            self.send_error(request_id, INTERNAL_ERROR, "internal error in sandboxd; the daemon's log has the details.")

    def handle_notification(self, method: str, params: Any) -> None:
        if method == "notifications/cancelled" and isinstance(params, dict):
            request_id = params.get("requestId")
            # Only ids a request can have; a list or an object would not even hash.
            valid = isinstance(request_id, (str, int, float)) and not isinstance(request_id, bool)
            ctx = self.calls.get(request_id) if valid else None
            if ctx is not None:
                reason = params.get("reason")
                ctx.cancel(reason if isinstance(reason, str) and reason else "cancelled by the client")
        # Unknown notifications are ignored, as JSON-RPC asks.

    def dispatch(self, request_id: Any, method: str, params: Any) -> None:
        server = self.server
        if method == "ping":
            return self.send({"jsonrpc": "2.0", "id": request_id, "result": {}})
        if method == "tools/list":
            if params is not None and not isinstance(params, dict):
                raise InvalidParams("tools/list params must be an object like {\"user\": \"alice@example.com\"}.")
            user = params.get("user") if params is not None else None
            user = None if user is None else check_user(user)
            if user is not None and not server.stopping:
                # A session lists its tools when it starts: its first call, seconds later, finds a warm sandbox.
                server.pool.warm(user)
            return self._answer_later(request_id, method, self._list_tools(user))
        if method == "sandbox/status":
            return self.send({"jsonrpc": "2.0", "id": request_id, "result": server.status()})
        if method == "tools/call":
            return self.start_call(request_id, params, time.monotonic())
        raise _MethodNotFound(method)

    async def _list_tools(self, user: str | None) -> dict[str, Any]:
        tools = await self.server.catalog.list_async(user)  # any scan runs in a worker thread
        return {"tools": [tool.to_protocol() for tool in tools]}

    def _answer_later(self, request_id: Any, method: str, work: Coroutine[Any, Any, dict[str, Any] | None]) -> None:
        """Answer from a task what waits for a tools scan (never run on the event loop's thread)."""

        async def answer() -> None:
            try:
                outcome = await work
            except SandboxdError as exc:
                return self.send_error(request_id, exc.code, exc.message, exc.data)
            except Exception:
                log.exception("request_failed", method=method)
                return self.send_error(request_id, INTERNAL_ERROR, "internal error in sandboxd; the daemon's log has the details.")
            if outcome is not None:
                self.send({"jsonrpc": "2.0", "id": request_id, "result": outcome})

        task = asyncio.get_running_loop().create_task(answer())
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _start_after_scan(self, request_id: Any, params: dict[str, Any], arrived: float, ctx: CallContext) -> None:
        try:
            await self.server.catalog.refresh(params.get("user"), since=arrived)
            if not self.closed:
                self.start_call(request_id, params, arrived, ctx)  # the lookup now trusts the scan just made
                return
        except BaseException:
            self._forget(ctx)
            raise
        self._forget(ctx)

    def _forget(self, ctx: CallContext) -> None:
        """A call that waited for a scan and never started: it is no longer in flight."""
        if self.calls.get(ctx.request_id) is ctx:
            del self.calls[ctx.request_id]
        self.server.calls_in_flight.discard(ctx)

    def start_call(self, request_id: Any, params: Any, arrived: float, ctx: CallContext | None = None) -> None:
        """Start a tools/call; ``ctx`` is the call's own context when it first waited for a tools scan."""
        server = self.server
        if ctx is None and request_id in self.calls:
            raise InvalidParams(f"id {request_id!r} is already used by a call in flight on this connection; use a fresh id.")
        if server.stopping and ctx is None:  # one already in flight (it waited for a scan) is shutdown's to end
            refusal = server.shutting_down_error()
            server.runner.count_refused(params, refusal)
            raise refusal
        try:
            call = parse_call_params(params, server.catalog, server.config, since=arrived)
        except ScanNeeded:
            # The tools changed since the last scan (the warm path is a few stat calls, here).
            # Registered now, so that a cancel, a disconnect or a reused id meanwhile finds it.
            if ctx is None:
                ctx = CallContext(request_id)
                self.calls[request_id] = ctx
                server.calls_in_flight.add(ctx)
            return self._answer_later(request_id, "tools/call", self._start_after_scan(request_id, params, arrived, ctx))
        meta = params.get("_meta") if isinstance(params.get("_meta"), dict) else {}
        token = meta.get("progressToken", request_id)
        if ctx is None:
            ctx = CallContext(request_id)
        counter = 0

        def on_progress(content: list[Any]) -> None:
            nonlocal counter
            counter += 1
            if self.writing_paused:
                self._pause_sandbox(ctx)
            self.send({"jsonrpc": "2.0", "method": "notifications/progress",
                       "params": {"progressToken": token, "progress": counter, "content": content}})

        async def run() -> None:
            started = time.monotonic()
            try:
                outcome = await server.runner.run(call, ctx, on_progress)
            except asyncio.CancelledError:
                if ctx.cancel_reason is None:
                    raise
                outcome = result("cancelled", text(f"The call was cancelled before it started ({ctx.cancel_reason})."), started)
            except SandboxdError as exc:
                return self.send_error(request_id, exc.code, exc.message, exc.data)
            except Exception:
                log.exception("call_failed", tool=call.tool.name)
                return self.send_error(request_id, INTERNAL_ERROR, "internal error in sandboxd; the daemon's log has the details.")
            finally:
                self._call_ended(ctx)
                self.calls.pop(request_id, None)
                server.calls_in_flight.discard(ctx)
            self.send({"jsonrpc": "2.0", "id": request_id, "result": outcome})

        self.calls[request_id] = ctx
        server.calls_in_flight.add(ctx)
        ctx.task = asyncio.get_running_loop().create_task(run())


class _MethodNotFound(SandboxdError):
    code = METHOD_NOT_FOUND

    def __init__(self, method: str) -> None:
        super().__init__(f"unknown method {method!r}; the methods are ping, tools/list, tools/call and sandbox/status.")
