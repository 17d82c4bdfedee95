"""A request on a sandbox's egress socket: its head read and checked into the request the proxy
forwards (written from what was parsed, never the sandbox's bytes), and the proxy's own answers."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

from sandboxd.egress.http1 import MAX_HEAD_BYTES, Head, Malformed, RequestReader
from sandboxd.rules.addresses import SCOPED
from sandboxd.rules.browser_relay import RELAY_NAME
from sandboxd.rules.policy import IPAddress, Verdict, is_host_name, parse_address

HEAD_TIMEOUT_S = 10.0
# Dropped from a forwarded request: they speak to the proxy, or ask for a connection we do not keep.
_HOP_HEADERS = frozenset({b"proxy-connection", b"proxy-authorization", b"connection", b"keep-alive"})


class Refused(Exception):
    """The request failed (not by policy): answer ``status`` and ``message``; ``reason`` is logged and counted."""

    def __init__(self, status: int, message: str, reason: str) -> None:
        super().__init__(message)
        self.status, self.message, self.reason = status, message, reason


_REASONS = {400: "Bad Request", 403: "Forbidden", 502: "Bad Gateway", 503: "Service Unavailable",
            504: "Gateway Timeout"}


def _answer(status: int, kind: str, message: str) -> bytes:
    body = (message.replace("\r", " ").replace("\n", " ") + "\n").encode()
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\nX-Sandboxd-Egress: {kind}\r\n"
            f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + body


class NoRequest(Exception):
    """The sandbox closed the connection without sending a byte: nothing to answer."""


async def read_head(conn: socket.socket, reader: RequestReader) -> None:
    """Feed ``reader`` until it has the request head (and what came with it); Malformed says what is wrong."""
    loop = asyncio.get_running_loop()
    received = False
    while reader.head is None:
        chunk = await loop.sock_recv(conn, 4096)
        if not chunk:
            if received:
                raise Malformed("the connection ended inside the request head")
            raise NoRequest
        received = True
        reader.feed(chunk)


async def reply(conn: socket.socket, status: int, kind: str, message: str) -> None:
    """Answer and end the request: the answer, then EOF, then what the client still sends is read and dropped
    (briefly: closing over unread bytes would reset the connection, and the client would see a reset
    instead of the answer)."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(HEAD_TIMEOUT_S):
            await loop.sock_sendall(conn, _answer(status, kind, message))
        conn.shutdown(socket.SHUT_WR)
        async with asyncio.timeout(1.0):
            await loop.sock_recv(conn, MAX_HEAD_BYTES)
    except (TimeoutError, OSError):
        pass


def parse_request(head: Head) -> tuple[str, str, str, int, bytes]:
    """(method, scheme, host, port, the request head to forward or b"") from a parsed head; ValueError says
    what is wrong. The head forwarded is written here from what was parsed, never the sandbox's bytes."""
    method, target = head.method, head.target
    if method == "CONNECT":
        host, port = _authority(target)
        return method, "", host, port, b""
    url = urlsplit(target)
    if url.scheme not in ("http", "https") or not url.netloc:
        raise ValueError(f"{target[:200]!r} is neither CONNECT host:port nor an absolute http:// URL")
    default_port = 443 if url.scheme == "https" else 80
    host, port = _authority(url.netloc if ":" in url.netloc.rsplit("]", 1)[-1] else f"{url.netloc}:{default_port}")
    if host == RELAY_NAME:
        raise ValueError(f"the browser relay is reached with CONNECT {RELAY_NAME}:PORT, not {method}")
    path = url.path or "/"
    if url.query:
        path += "?" + url.query
    # Host is the URL's, whatever the request said (RFC 9112, 3.2.2): a Host of its own would let a tool
    # send a request checked for one name to another site on the same server (a CDN's), secrets and all.
    headers = [name + b": " + value for name, value in head.headers if name.lower() not in _HOP_HEADERS | {b"host"}]
    headers.insert(0, b"Host: " + url.netloc.encode())
    forward = b"\r\n".join([f"{method} {path} HTTP/1.1".encode(), *headers, b"Connection: close", b"", b""])
    return method, url.scheme, host, port, forward


def _authority(text: str) -> tuple[str, int]:
    if "@" in text:
        raise ValueError(f"{text[:200]!r}: credentials in the address are not accepted")
    host, sep, port_text = text.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{text[:200]!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        if parse_address(host) is None:
            raise ValueError(f"{text[:200]!r}: [{host}] is not an IPv6 address")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"{text[:200]!r}: {port_text[:20]!r} is not a port (1-65535)")
    host = host.lower().rstrip(".")
    if parse_address(host) is None and not is_host_name(host):
        raise ValueError(f"{host[:200]!r} is not a host name or an IP address")
    return host, int(port_text)


def refusal_message(host: str, port: int, address: IPAddress | None, verdict: Verdict) -> str:
    where = f"{host}:{port}" if address is None or str(address) == host else f"{host}:{port} ({address})"
    if verdict.reason.startswith("egress.policy is none"):
        hint = "the operator can change egress.policy"
    elif verdict.reason.startswith("port "):
        hint = "the operator can add the port to egress.ports, or name host:port in egress.allow"
    elif verdict.reason.startswith("not in egress.allow"):
        hint = "the operator can add it to egress.allow"
    elif verdict.reason == SCOPED:
        hint = "send the address without its %zone, or the operator can allow it with egress.allow"
    else:
        hint = "the operator can allow it with egress.allow"
    return f"egress to {where} refused by sandboxd's egress policy: {verdict.reason}; {hint}"
