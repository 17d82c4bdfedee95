"""Binding a listening unix socket safely: used by the API socket and the metrics socket."""

from __future__ import annotations

import grp
import os
import socket
from pathlib import Path


def bind_unix_socket(path: Path, *, mode: int, group: str | None, backlog: int, in_use_hint: str) -> socket.socket:
    """Bind ``path`` with ``mode`` (and ``group``) from the first instant; replace a stale file.

    A file that still accepts connections belongs to a live server: that is an OSError
    ending with ``in_use_hint`` (what the operator should do), never a takeover.
    """
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale, left by a process that died
        else:
            raise OSError(f"something already listens on {path}; {in_use_hint}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # A tight umask while binding: there is no moment at which the socket is wider than asked.
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    if group:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    os.chmod(path, mode)
    sock.listen(backlog)
    sock.setblocking(False)
    return sock
