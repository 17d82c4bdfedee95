"""Streamable HTTP (path /mcp) for hosts that do not run `sandboxd mcp` themselves.

Every request needs ``Authorization: Bearer $SANDBOXD_MCP_TOKEN`` (else 401; compared in
constant time) and, when it carries an ``Origin``, one this server serves (else 403, as the
MCP spec asks against DNS rebinding): its own loopback origins and those named with
``--allow-origin`` (a TLS proxy's public origin). It listens on a loopback address unless
``allow_unsafe`` names ``mcp_http_remote``: anything further is a TLS proxy's job.
A POST body with a key twice in one object is answered 400 and never run (sandboxd.mcp.strict).
Connections are bounded before the token is seen, and those that never carried it are
closed first (sandboxd.mcp.connections); sessions by
the SDK's cap and idle expiry, set from HttpLimits.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from collections import deque
from typing import Any, Iterable, Mapping
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandboxd.hostport import parse_host_port
from sandboxd.errors import ConfigError
from sandboxd.mcp.limits import HttpLimits
from sandboxd.mcp.strict import duplicate_key_error
from sandboxd.wire import INVALID_REQUEST, ErrorResponse, error_object, error_response

PATH = "/mcp"
TOKEN_ENV = "SANDBOXD_MCP_TOKEN"
MIN_TOKEN_CHARS = 32
REMOTE = "mcp_http_remote"


def parse_address(value: str, allow_unsafe: Iterable[str] = ()) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6, ``localhost`` for 127.0.0.1) → (address, port); ConfigError naming the fix."""
    try:
        address, port = parse_host_port(value, example="--http 127.0.0.1:8765")
    except ValueError as error:
        raise ConfigError(f"--http {error}") from None
    if not address.is_loopback and REMOTE not in allow_unsafe:
        raise ConfigError(
            f"--http {value!r} is not a loopback address: anyone who can reach it could try the token, and it "
            "speaks plain HTTP. Listen on 127.0.0.1 behind a TLS proxy (docs/mcp.md), or set "
            f"allow_unsafe: [{REMOTE}] to accept it.")
    return str(address), port


def token_from(environ: Mapping[str, str]) -> bytes:
    token = environ.get(TOKEN_ENV, "").strip()
    if len(token) < MIN_TOKEN_CHARS:
        what = "is not set" if not token else f"has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}"
        raise ConfigError(f"--http needs a bearer token in ${TOKEN_ENV}, which {what}; make one with "
                          f"`export {TOKEN_ENV}=$(openssl rand -hex 32)` and give hosts the same value.")
    return token.encode()


def authorized(header: str | None, token: bytes) -> bool:
    """Whether an Authorization header carries ``Bearer <token>``, compared in constant time."""
    scheme, _, credential = (header or "").partition(" ")
    return hmac.compare_digest(credential.strip().encode(), token) and scheme.lower() == "bearer"


def own_origins(host: str, port: int, extra: Iterable[str] = ()) -> tuple[set[str], set[str]]:
    """(origins, Host header values) this server answers: its own address and ``extra`` origins."""
    names = {"127.0.0.1", "localhost", "[::1]"} if ipaddress.ip_address(host).is_loopback else set()
    names.add(f"[{host}]" if ":" in host else host)
    hosts = {f"{name}:{port}" for name in names}
    origins = {f"http://{value}" for value in hosts}
    for origin in extra:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/"):
            raise ConfigError(f"--allow-origin {origin!r} is not an origin like https://mcp.example.com")
        origins.add(f"{parts.scheme}://{parts.netloc}")
        hosts.add(parts.netloc)
    return origins, hosts


class Guard:
    """ASGI middleware in front of the SDK's app: the token first, then the Origin, then duplicate keys."""

    def __init__(self, app: ASGIApp, token: bytes, origins: set[str], *, max_body: int, limits: HttpLimits) -> None:
        self.app, self.token, self.origins = app, token, origins
        self.max_body, self.limits = max_body, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = Headers(scope=scope)
            if not authorized(headers.get("authorization"), self.token):
                # Closed after the answer: a connection without the token holds no slot for its next try.
                return await _refuse(send, 401, f"a valid 'Authorization: Bearer <token>' header is needed (${TOKEN_ENV}).",
                                     ((b"www-authenticate", b'Bearer realm="sandboxd"'), (b"connection", b"close")))
            origin = headers.get("origin")
            if origin is not None and origin not in self.origins:
                return await _refuse(send, 403, f"Origin {origin[:200]!r} is not one this server serves; "
                                                "name it with --allow-origin if it should be.")
            if scope["method"] == "POST":
                replay = await self._strict_body(receive, send)
                if replay is None:
                    return
                receive = replay
            send = self._session_cap_said_plainly(send)
        elif scope["type"] != "lifespan":
            return  # websockets: not served
        await self.app(scope, receive, send)

    async def _strict_body(self, receive: Receive, send: Send) -> Receive | None:
        """A ``receive`` that replays the body read here, or None once a duplicate key in it was answered 400.

        A body over max_body is not checked: the SDK refuses it (413) as it reads on.
        """
        read: deque[Message] = deque()
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            read.append(message)
            if message["type"] != "http.request":
                break  # the client went away: the SDK hears it from the replay
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if not message.get("more_body", False) or size > self.max_body:
                break
        if read[-1]["type"] == "http.request" and not read[-1].get("more_body", False) and size <= self.max_body:
            refused = duplicate_key_error(b"".join(chunks))
            if refused is not None:
                await _send_json(send, 400, refused)
                return None

        async def replay() -> Message:
            return read.popleft() if read else await receive()

        return replay

    def _session_cap_said_plainly(self, send: Send) -> Send:
        """The SDK's 503 at its session cap ("Too many open sessions") with what it means and what to do."""
        refusing = False

        async def said(message: Message) -> None:
            nonlocal refusing
            if message["type"] == "http.response.start" and message["status"] == 503:
                refusing = True
                await _refuse(send, 503, f"this server holds {self.limits.max_sessions} sessions (--max-sessions), "
                                         "the most it allows; end one (DELETE /mcp) or wait: a session idle for "
                                         f"{self.limits.session_idle_s:g} s is closed (--session-idle-timeout).",
                              ((b"retry-after", b"10"),))
            elif not refusing:
                await send(message)

        return said


async def _refuse(send: Send, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    await _send_json(send, status, error_response(None, error_object(INVALID_REQUEST, message)), headers)


async def _send_json(send: Send, status: int, answer: ErrorResponse,
                     headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(answer).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def app(server: Any, *, host: str, port: int, token: bytes, extra_origins: Iterable[str], max_body: int,
        limits: HttpLimits) -> ASGIApp:
    from mcp.server.transport_security import TransportSecuritySettings

    origins, hosts = own_origins(host, port, extra_origins)
    inner = server.streamable_http_app(
        streamable_http_path=PATH, max_request_body_size=max_body, host=host,
        max_sessions=limits.max_sessions, session_idle_timeout=limits.session_idle_s,
        # The SDK checks Host (DNS rebinding) and Origin again behind the Guard.
        transport_security=TransportSecuritySettings(allowed_hosts=sorted(hosts), allowed_origins=sorted(origins)),
    )
    return Guard(inner, token, origins, max_body=max_body, limits=limits)
