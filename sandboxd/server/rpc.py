"""JSON-RPC 2.0 for one connection: a message in, a method from the table, its answer out (the MCP SDK's shape).

Methods never see the envelope: a method gets (request id, params) and returns its
result, or ``Later`` (work answered from a task when it completes; None means no
answer), or raises. The dispatcher checks every message (docs/protocol.md), puts the
id on the answer, and maps errors to the wire in one place (``error_body``): a
SandboxdError carries its code, anything else is -32603 with the details in the log.

Like the MCP SDK's session, the dispatcher owns the requests in flight: their ids, from
the request to its answer (another request answered later may not take one meanwhile; one
answered at once, a ping, may), and what reaches them meanwhile: a
``notifications/cancelled`` the one it names, the client's disconnect and its
back-pressure every one (``InFlight``: a tools/call's ``CallContext``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine, Mapping, NamedTuple, Protocol, Union

from sandboxd import strictjson
from sandboxd.errors import InvalidParams, MethodNotFound, SandboxdError
from sandboxd.logging import get_logger, source

log = get_logger("sandboxd.server")

PARSE_ERROR, INVALID_REQUEST, INTERNAL_ERROR = -32700, -32600, -32603
CANCELLED = "notifications/cancelled"


class InFlight(Protocol):
    """What a request answered later lets the dispatcher do to it meanwhile."""

    def cancel(self, reason: str) -> None:
        """Stop it: answered as cancelled (a cancel notification, or the client went away)."""

    def pause(self) -> None:
        """The client reads no more: stop producing output for it."""

    def resume(self) -> None: ...


Result = dict[str, Any]


class Later(NamedTuple):
    """A method's answer to come: ``work`` settles it (None: nothing is sent), ``request`` is what
    a cancel, the disconnect or back-pressure acts on meanwhile (None: nothing can be). Nothing of
    the request is in flight before ``work`` starts: a refused one is dropped unstarted."""

    work: Coroutine[Any, Any, Union[Result, None]]
    request: InFlight | None = None


Method = Callable[[Any, Any], Union[Result, Later]]  # (request id, params)


encode = strictjson.dumps_line  # one message, one line


def notification(method: str, params: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": params}


def error_body(exc: BaseException, method: str | None = None) -> dict[str, Any]:
    """The one mapping of an error to the wire."""
    if not isinstance(exc, SandboxdError):
        log.error("request_failed", method=method, exc_info=exc, budget=source("method", method))
        return {"code": INTERNAL_ERROR, "message": "internal error in sandboxd; the daemon's log has the details."}
    error: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if exc.data is not None:
        error["data"] = exc.data
    return error


def is_request_id(value: Any) -> bool:
    """A string or a number (not a bool), that JavaScript reads back as itself."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):  # past a double's range, JavaScript reads it as Infinity
        return abs(value) <= strictjson.MAX_DOUBLE_INT
    return isinstance(value, (str, float))


class Dispatcher:
    def __init__(self, send: Callable[[dict[str, Any]], None], methods: Mapping[str, Method]) -> None:
        self._send = send
        self._methods = methods
        self._in_flight: dict[Any, InFlight | None] = {}  # by request id, until answered
        # The tasks that answer them (the loop keeps only a weak reference), by id: dropped as they answer.
        self._answering: dict[Any, asyncio.Task[None]] = {}

    def reply(self, request_id: Any, result: Result) -> None:
        self._send({"jsonrpc": "2.0", "id": request_id, "result": result})

    def reply_error(self, request_id: Any, exc: BaseException, method: str | None = None) -> None:
        self._send({"jsonrpc": "2.0", "id": request_id, "error": error_body(exc, method)})

    def handle_line(self, line: bytes) -> None:
        try:
            request_id, method, params, is_request = _parse(line)
        except _Refused as refused:
            if not line.strip():
                return  # a blank line is no message (checked here only, so no line is stripped)
            return self._send({"jsonrpc": "2.0", "id": refused.request_id,
                               "error": {"code": refused.code, "message": refused.message}})
        if not is_request:
            if method == CANCELLED:
                self._cancel(params)
            return  # other notifications are ignored, as JSON-RPC asks
        try:
            handler = self._methods.get(method)
            if handler is None:
                raise MethodNotFound(f"unknown method {method!r}; the methods are {_names(self._methods)}.")
            answer = handler(request_id, params)
            if isinstance(answer, dict):
                return self.reply(request_id, answer)
            if request_id in self._in_flight:
                answer.work.close()  # never started: nothing of it to undo
                raise InvalidParams(f"id {request_id!r} is already used by a request in flight on this connection; "
                                    "use a fresh id.")
        except Exception as exc:
            return self.reply_error(request_id, exc, method)
        self._in_flight[request_id] = answer.request
        # Named by its method, so no "Task-<n>" name is formatted for it.
        self._answering[request_id] = asyncio.Task(self._answer(request_id, method, answer.work),
                                                   loop=asyncio.get_running_loop(), name=method)

    async def _answer(self, request_id: Any, method: str, work: Coroutine[Any, Any, Result | None]) -> None:
        try:
            result = await work
        except Exception as exc:
            self._done(request_id)
            return self.reply_error(request_id, exc, method)
        self._done(request_id)
        if result is not None:
            self.reply(request_id, result)

    def _done(self, request_id: Any) -> None:
        """Free the id before the answer goes out: a client may reuse it once answered. (The running
        task needs no reference of ours: the loop holds it until this step ends.)"""
        del self._in_flight[request_id]
        del self._answering[request_id]

    def _cancel(self, params: Any) -> None:
        """notifications/cancelled: cancel the request of ``params.requestId`` if it is in flight here."""
        if not isinstance(params, dict):
            return
        request_id = params.get("requestId")
        # Only ids a request can have; a list or an object would not even hash.
        request = self._in_flight.get(request_id) if is_request_id(request_id) else None
        if request is not None:
            reason = params.get("reason")
            request.cancel(reason if isinstance(reason, str) and reason else "cancelled by the client")

    def disconnected(self) -> None:
        """The client went away: every request it has in flight is cancelled (nobody reads the answers)."""
        for request in list(self._in_flight.values()):
            if request is not None:
                request.cancel("client disconnected")

    def pause(self) -> None:
        """The client reads no more: every request in flight stops producing output for it."""
        for request in self._in_flight.values():
            if request is not None:
                request.pause()

    def resume(self) -> None:
        for request in self._in_flight.values():
            if request is not None:
                request.resume()


def _parse(line: bytes) -> tuple[Any, str, Any, bool]:
    """(id, method, params, is a request) of a well-formed message; raises _Refused naming the problem."""
    try:
        message = strictjson.loads(line, unique_keys=True)
    except UnicodeDecodeError:
        raise _Refused(PARSE_ERROR, "message is not valid UTF-8; send UTF-8 JSON.") from None
    except strictjson.DuplicateKey as exc:
        # Which value would win is parser-dependent: refused, not guessed (docs/protocol.md).
        raise _Refused(INVALID_REQUEST, f"{exc}; send every key of an object once.") from None
    except RecursionError:
        raise _Refused(PARSE_ERROR, "message is nested too deeply to parse.") from None
    except ValueError as exc:
        raise _Refused(PARSE_ERROR, f"message is not JSON: {exc}.") from None
    if not isinstance(message, dict):
        if isinstance(message, list):
            raise _Refused(INVALID_REQUEST, "batches are not supported; send one request per line.")
        raise _Refused(INVALID_REQUEST, "a message must be a JSON-RPC 2.0 object.")
    request_id = message.get("id")
    if request_id is not None and not is_request_id(request_id):
        if isinstance(request_id, int) and not isinstance(request_id, bool):
            # JavaScript reads it as Infinity: no client could match the answer to its request.
            raise _Refused(INVALID_REQUEST, "'id' is a number too large for a double; use a smaller number or a string.")
        raise _Refused(INVALID_REQUEST, "'id' must be a string or a number.")
    method = message.get("method")
    if message.get("jsonrpc") != "2.0" or not isinstance(method, str):
        raise _Refused(INVALID_REQUEST, "not a JSON-RPC 2.0 request: it needs \"jsonrpc\": \"2.0\" and a \"method\" string.",
                       request_id)
    return request_id, method, message.get("params"), "id" in message


class _Refused(Exception):
    """A message that is not well-formed JSON-RPC 2.0: answered with ``code`` (and its id, when it had a usable one)."""

    def __init__(self, code: int, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id


def _names(methods: Mapping[str, Method]) -> str:
    names = list(methods)
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else ", ".join(names)
