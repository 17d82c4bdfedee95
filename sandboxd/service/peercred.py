"""Who is on the other end of a client connection, and may they talk to us.

The socket file's mode (0660) and group already decide who can connect; the
peer check narrows that further when ``allowed_uids`` / ``allowed_gids`` are
set. The kernel records the peer's credentials at connect() time
(SO_PEERCRED: pid, uid, gid; SO_PEERGROUPS: supplementary groups), so they
cannot be forged by the client.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from sandboxd.config import Config
from sandboxd.logging import get_logger, source

log = get_logger("sandboxd.peer")

_UCRED = struct.Struct("=iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid
_GID = struct.Struct("=I")
SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux ≥ 4.13; Python 3.11 does not name it
# Python caps getsockopt buffers at 1024 bytes: 256 groups. Peers in more are judged without them.
_GROUPS_BUFFER = 1024


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int
    groups: tuple[int, ...] = ()


def peer_credentials(sock: Any) -> PeerCredentials:
    """Credentials of the process that connected ``sock`` (a socket or asyncio's TransportSocket)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GROUPS_BUFFER)
        groups = tuple(g for (g,) in _GID.iter_unpack(raw[: len(raw) - len(raw) % _GID.size]))
    except OSError:  # an older kernel, or more groups than fit the buffer
        groups = ()
    return PeerCredentials(pid, uid, gid, groups)


@dataclass(frozen=True)
class PeerPolicy:
    uids: frozenset[int]
    gids: frozenset[int]
    daemon_uid: int

    @classmethod
    def from_config(cls, config: Config) -> PeerPolicy:
        return cls(frozenset(config.allowed_uids), frozenset(config.allowed_gids), os.geteuid())

    @property
    def restricted(self) -> bool:
        return bool(self.uids or self.gids)

    def allows(self, peer: PeerCredentials) -> bool:
        if not self.restricted:
            return True
        # Root and the daemon's own user could read its state anyway; refusing them protects nothing.
        if peer.uid in (0, self.daemon_uid) or peer.uid in self.uids:
            return True
        return peer.gid in self.gids or not self.gids.isdisjoint(peer.groups)

    def refusal(self, sock: Any) -> str | None:
        """None if the peer on ``sock`` may talk; otherwise the one sentence it is told. Logs refusals."""
        if not self.restricted:
            return None  # no syscall on the common path
        try:
            peer = peer_credentials(sock)
        except OSError as exc:
            log.warning("peer_refused", reason=f"credentials unreadable: {exc}", budget=source("peer", "unreadable"))
            return "sandboxd could not read this connection's credentials (SO_PEERCRED) and refuses it."
        if self.allows(peer):
            return None
        # A client reconnecting in a loop is one source: its uid's budget.
        log.warning("peer_refused", pid=peer.pid, uid=peer.uid, gid=peer.gid, groups=list(peer.groups),
                    budget=source("peer", peer.uid))
        return (
            f"uid {peer.uid} (gid {peer.gid}) may not use this sandboxd; ask its administrator to add the uid "
            "to allowed_uids or one of its groups to allowed_gids in the daemon's config."
        )
