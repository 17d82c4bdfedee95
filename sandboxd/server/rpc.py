"""JSON-RPC 2.0 for one connection: a message in, a method from the table, its answer out (the MCP SDK's shape).

Methods never see the envelope: a method gets (request id, params) and returns its
result, or ``Later`` (work answered from a task when it completes; None means no
answer), or raises. The dispatcher checks every message (docs/protocol.md), puts the
id on the answer, and maps errors to the wire in one place (``error_body``): a
SandboxdError carries its code, anything else is -32603 with the details in the log.
The messages themselves, and the reading of a line, are sandboxd.wire's.

Like the MCP SDK's session, the dispatcher owns the requests in flight: their ids, from
the request to its answer (another request answered later may not take one meanwhile; one
answered at once, a ping, may), and what reaches them meanwhile: a
``notifications/cancelled`` the one it names, the client's disconnect and its
back-pressure every one (``InFlight``: a tools/call's ``CallContext``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Coroutine, Mapping, NamedTuple, Protocol, Union

from sandboxd.errors import InvalidParams, MethodNotFound, SandboxdError
from sandboxd.logging import get_logger, source
from sandboxd.server.raw import Raw
from sandboxd.wire import (CANCELLED, INTERNAL_ERROR, ErrorObject, Malformed, Message, error_object, error_response,
                           is_request_id, parse_request, response)

log = get_logger("sandboxd.server")


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


Method = Callable[[Any, Any], Union[Result, Later, Raw]]  # (request id, params)


def error_body(exc: BaseException, method: str | None = None) -> ErrorObject:
    """The one mapping of an error to the wire."""
    if not isinstance(exc, SandboxdError):
        log.error("request_failed", method=method, exc_info=exc, budget=source("method", method))
        return error_object(INTERNAL_ERROR, "internal error in sandboxd; the daemon's log has the details.")
    return error_object(exc.code, exc.message, exc.data)


class Dispatcher:
    def __init__(self, send: Callable[[Message], None], methods: Mapping[str, Method],
                 raw: Callable[[Any, Raw], Later] | None = None) -> None:
        self._send = send
        self._methods = methods
        self._raw = raw  # the connection's: a raw method's answer made the Later that takes its bytes over
        self._in_flight: dict[Any, InFlight | None] = {}  # by request id, until answered
        # The tasks that answer them (the loop keeps only a weak reference), by id: dropped as they answer.
        self._answering: dict[Any, asyncio.Task[None]] = {}

    def reply_error(self, request_id: Any, exc: BaseException, method: str | None = None) -> None:
        self._send(error_response(request_id, error_body(exc, method)))

    def handle_line(self, line: bytes) -> None:
        try:
            request_id, method, params, is_request = parse_request(line)
        except Malformed as malformed:
            if not line.strip():
                return  # a blank line is no message (checked here only, so no line is stripped)
            return self._send(malformed.answer())
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
                return self._send(response(request_id, answer))
            if isinstance(answer, Raw):
                if self._raw is None:
                    raise InvalidParams(f"{method} needs a connection of its own; it cannot be called here.")
                answer = self._raw(request_id, answer)  # InvalidParams when the connection is not fresh
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
            self._send(response(request_id, result))

    @property
    def busy(self) -> bool:
        """Whether a request is in flight."""
        return bool(self._in_flight)

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


def _names(methods: Mapping[str, Method]) -> str:
    names = list(methods)
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else ", ".join(names)
