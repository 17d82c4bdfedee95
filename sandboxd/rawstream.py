"""The client's half of a raw method (server/raw.py): ``users/export`` and ``users/import`` on a connection of their own.

Works on any connected stream socket (the unix socket here; a TLS one for a peer elsewhere).
"""

from __future__ import annotations

import socket
from typing import Any, Iterable, Iterator

from sandboxd import strictjson
from sandboxd.wire import RpcError, request

CHUNK = 1 << 20


def _answer(sock: socket.socket, buffered: bytes = b"") -> tuple[dict[str, Any], bytes]:
    """The daemon's one JSON line, and the raw bytes read after it. RpcError when it is an error."""
    data = buffered
    while b"\n" not in data:
        chunk = sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError("sandboxd closed the connection without an answer")
        data += chunk
    line, rest = data.split(b"\n", 1)
    reply: dict[str, Any] = strictjson.loads_line(line)
    if "error" in reply:
        raise RpcError.from_error(reply["error"])
    return reply.get("result") or {}, rest


def export(sock: socket.socket, params: dict[str, Any],
           method: str = "users/export") -> tuple[dict[str, Any], Iterator[bytes]]:
    """Ask for an export (or a move's ``users/handover``): the daemon's answer, and the archive's bytes until it
    closes the connection."""
    sock.sendall(strictjson.dumps_line(request(1, method, params)))
    result, rest = _answer(sock)

    def archive() -> Iterator[bytes]:
        if rest:
            yield rest
        while chunk := sock.recv(CHUNK):
            yield chunk

    return result, archive()


def import_(sock: socket.socket, archive: Iterable[bytes], params: dict[str, Any] | None = None, *,
            half_close: bool = True) -> dict[str, Any]:
    """Send an archive to import, half-close, and return the daemon's answer (RpcError when it refused it).

    A daemon that refuses the archive part-way answers and closes before it is all sent: the
    answer is read then, and the rest never sent. ``half_close=False`` for TLS, which has none: the
    daemon reads up to the archive's own end and answers then."""
    sock.sendall(strictjson.dumps_line(request(1, "users/import", params or {})))
    try:
        for chunk in archive:
            sock.sendall(chunk)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError):
        pass  # it answered already: read below
    return _answer(sock)[0]
