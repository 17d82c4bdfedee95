"""A move's target pulls the user from the source (blocking, for a worker thread): one TLS connection as this
node, ``users/handover`` on it (raw: server/raw.py), and the archive imported as its bytes arrive.

The source must show the certificate ``node:SOURCE``; the import checks every entry against the
manifest (sha256, sizes, the quota) and puts nothing in place unless all of it holds.
"""

from __future__ import annotations

import socket
from typing import Any, Iterator

from sandboxd import rawstream
from sandboxd.cluster.dial import DIAL_TIMEOUT_S, DialFailed, split_address
from sandboxd.cluster.tls import Role, RoleRefused, client_context, role_of
from sandboxd.config import Config
from sandboxd.errors import InvalidParams
from sandboxd.storage.transfer.importer import Imported, Ownership, import_user
from sandboxd.storage.transfer.manifest import ArchiveRefused
from sandboxd.wire import RpcError

STALL_S = 120.0  # beyond the move's wait: what the source may take to snapshot (hash) the user, or between chunks


def pull_user(config: Config, address: str, source: str, params: dict[str, Any]) -> Imported:
    """Import the user ``params`` names from ``source`` at ``address``; ArchiveRefused, InvalidParams or
    DialFailed say why not (nothing of the user is left here then)."""
    assert config.cluster is not None
    host, port = split_address(address)
    try:
        raw = socket.create_connection((host, port), timeout=DIAL_TIMEOUT_S)
    except OSError as exc:
        raise DialFailed(f"the source {source} at {address} could not be reached ({exc.strerror or exc}).") from None
    with client_context(config.cluster.tls).wrap_socket(raw) as sock:
        shown = _role(sock)
        if shown != Role("node", source):
            raise DialFailed(f"{address} is {shown}, not node:{source}: the directory's address names another host.")
        sock.settimeout(float(params.get("waitMs") or 0) / 1000 + STALL_S)
        chunks = _handover(sock, params)
        try:
            return import_user(config, _Reader(chunks).read, Ownership.of(config))
        except (ConnectionError, TimeoutError) as exc:
            raise ArchiveRefused("the archive", f"the source's stream ended early ({exc})") from None


def _role(sock: Any) -> Role:
    try:
        return role_of(sock.getpeercert())
    except RoleRefused as exc:
        raise DialFailed(f"the source shows a certificate of no role ({exc}).") from None


def _handover(sock: Any, params: dict[str, Any]) -> Iterator[bytes]:
    """Ask for the user; the archive's bytes after the source's one JSON line (its error raised as InvalidParams)."""
    try:
        _, chunks = rawstream.export(sock, params, "users/handover")
    except RpcError as exc:
        raise InvalidParams(f"the source refused the handover: {exc.message}") from None
    except ConnectionError:
        raise InvalidParams("the source closed the connection without an answer (its log says why).") from None
    return chunks


class _Reader:
    """``read(n)`` over the chunks (the import reads in pieces of its own size)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks, self._rest = chunks, b""

    def read(self, n: int) -> bytes:
        if not self._rest:
            self._rest = next(self._chunks, b"")
        piece, self._rest = self._rest[:n], self._rest[n:]
        return piece
