"""JSON-RPC 2.0 messages: the one place their shapes are named, built and read (docs/protocol.md).

Every message sandboxd sends is built here: to its clients (the daemon's answers and
notifications), to a sandbox's shim (calls, cancels, shutdown), to the daemon (the
clients, ``sandboxd mcp``'s bridge) and to MCP hosts (the refusals of the stdio and HTTP
transports). The shapes are TypedDicts and the builders plain functions returning plain
dicts: the warm call builds two messages, and a class per message would cost more than
the dicts it writes. Each builder keeps the key order that clients have always read, so
the encoded bytes are those the hand-built dicts wrote (tests/unit/test_wire.py).

Reading is here too: ``parse_request`` is the daemon's strict reading of a client's line,
``RpcError.from_error`` a client's reading of an error answer, and ``kind`` and ``with_id``
what a router needs to forward a message with its id rewritten.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict, Union, cast

from sandboxd import strictjson

VERSION: Literal["2.0"] = "2.0"
PARSE_ERROR, INVALID_REQUEST, INTERNAL_ERROR = -32700, -32600, -32603

CANCELLED = "notifications/cancelled"
PROGRESS = "notifications/progress"
TOOLS_LIST_CHANGED = "notifications/tools/list_changed"

RequestId = Union[str, int, float]  # what is_request_id accepts; None on an error tied to no request

encode = strictjson.dumps_line  # one message, one line of compact UTF-8 JSON


class ErrorObject(TypedDict):
    code: int
    message: str
    data: NotRequired[Any]


class Request(TypedDict):
    jsonrpc: Literal["2.0"]
    id: RequestId
    method: str
    params: NotRequired[Any]


class Notification(TypedDict):
    jsonrpc: Literal["2.0"]
    method: str
    params: NotRequired[Any]


class Response(TypedDict):
    jsonrpc: Literal["2.0"]
    id: RequestId
    result: dict[str, Any]


class ErrorResponse(TypedDict):
    jsonrpc: Literal["2.0"]
    id: RequestId | None
    error: ErrorObject


Message = Union[Request, Notification, Response, ErrorResponse]


# -- building -------------------------------------------------------------------------------------


def request(request_id: RequestId, method: str, params: Any = None) -> Request:
    """A request; without ``params`` it has none (not ``"params": null``)."""
    if params is None:
        return {"jsonrpc": "2.0", "id": request_id, "method": method}
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}


def notification(method: str, params: Any = None) -> Notification:
    if params is None:
        return {"jsonrpc": "2.0", "method": method}
    return {"jsonrpc": "2.0", "method": method, "params": params}


def response(request_id: RequestId, result: dict[str, Any]) -> Response:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def error_object(code: int, message: str, data: Any = None) -> ErrorObject:
    """An error's body; ``data`` only when there is some."""
    if data is None:
        return {"code": code, "message": message}
    return {"code": code, "message": message, "data": data}


def error_response(request_id: RequestId | None, error: ErrorObject) -> ErrorResponse:
    """An error answer; id None when no request could be named (an unreadable line, a refused peer)."""
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def cancelled(request_id: RequestId, reason: str) -> Notification:
    """notifications/cancelled: stop the request ``request_id``; it gets no answer (or a cancelled one)."""
    return {"jsonrpc": "2.0", "method": CANCELLED, "params": {"requestId": request_id, "reason": reason}}


def progress(token: Any, count: int, content: list[Any]) -> Notification:
    """notifications/progress: the ``count``-th update (from 1) of the call whose progress token is ``token``."""
    return {"jsonrpc": "2.0", "method": PROGRESS, "params": {"progressToken": token, "progress": count, "content": content}}


# -- reading ----------------------------------------------------------------------------------------


class Malformed(Exception):
    """A line that is not a well-formed JSON-RPC 2.0 message: answered with ``code`` (and its id, when usable)."""

    def __init__(self, code: int, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.request_id = code, message, request_id

    def answer(self) -> ErrorResponse:
        return error_response(self.request_id, error_object(self.code, self.message))


class RpcError(Exception):
    """An error answer, as a client raises it: ``message`` is what a person reads, ``code`` is for programs."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    @classmethod
    def from_error(cls, error: Any) -> RpcError:
        """The exception an answer's ``error`` member stands for."""
        return cls(error.get("code", 0), error.get("message", ""), error.get("data"))


def is_request_id(value: Any) -> bool:
    """A string or a number (not a bool), that JavaScript reads back as itself."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):  # past a double's range, JavaScript reads it as Infinity
        return abs(value) <= strictjson.MAX_DOUBLE_INT
    return isinstance(value, (str, float))


def parse_request(line: bytes) -> tuple[Any, str, Any, bool]:
    """(id, method, params, is a request) of a well-formed message; raises Malformed naming the problem.

    Strict, as the daemon reads its clients: UTF-8, no key twice, one object, an id JavaScript reads back."""
    try:
        message = strictjson.loads(line, unique_keys=True)
    except UnicodeDecodeError:
        raise Malformed(PARSE_ERROR, "message is not valid UTF-8; send UTF-8 JSON.") from None
    except strictjson.DuplicateKey as exc:
        # Which value would win is parser-dependent: refused, not guessed (docs/protocol.md).
        raise Malformed(INVALID_REQUEST, f"{exc}; send every key of an object once.") from None
    except RecursionError:
        raise Malformed(PARSE_ERROR, "message is nested too deeply to parse.") from None
    except ValueError as exc:
        raise Malformed(PARSE_ERROR, f"message is not JSON: {exc}.") from None
    if not isinstance(message, dict):
        if isinstance(message, list):
            raise Malformed(INVALID_REQUEST, "batches are not supported; send one request per line.")
        raise Malformed(INVALID_REQUEST, "a message must be a JSON-RPC 2.0 object.")
    request_id = message.get("id")
    if request_id is not None and not is_request_id(request_id):
        if isinstance(request_id, int) and not isinstance(request_id, bool):
            # JavaScript reads it as Infinity: no client could match the answer to its request.
            raise Malformed(INVALID_REQUEST, "'id' is a number too large for a double; use a smaller number or a string.")
        raise Malformed(INVALID_REQUEST, "'id' must be a string or a number.")
    method = message.get("method")
    if message.get("jsonrpc") != "2.0" or not isinstance(method, str):
        raise Malformed(INVALID_REQUEST, "not a JSON-RPC 2.0 request: it needs \"jsonrpc\": \"2.0\" and a \"method\" string.",
                        request_id)
    return request_id, method, message.get("params"), "id" in message


def kind(message: dict[str, Any]) -> Literal["request", "notification", "response", "error", "unknown"]:
    """What a parsed message is, by its members (JSON-RPC 2.0, section 4 and 5)."""
    if isinstance(message.get("method"), str):
        return "request" if "id" in message else "notification"
    if "id" in message:
        if "result" in message:
            return "response"
        if "error" in message:
            return "error"
    return "unknown"


def with_progress_token(params: dict[str, Any], token: Any) -> dict[str, Any]:
    """A progress notification's params with its token replaced (a router's, between an upstream's and its client's)."""
    return {**params, "progressToken": token}


def with_meta_progress_token(params: dict[str, Any], meta: dict[str, Any], token: RequestId) -> dict[str, Any]:
    """A request's params asking for progress under ``token``, the rest of its ``_meta`` kept."""
    return {**params, "_meta": {**meta, "progressToken": token}}


def with_id(message: Message, request_id: RequestId | None) -> Message:
    """A request or an answer with its id replaced (a router's rewriting between a client's ids and an upstream's).

    The id keeps its place among the keys, so the line differs from the original only in the id."""
    return cast(Message, {**message, "id": request_id})
