"""Binding a listening unix socket safely: used by the API socket and the metrics socket."""

from __future__ import annotations

import grp
import os
import socket
import stat
from pathlib import Path


def secure_directory(path: Path, *, mode: int, what: str) -> None:
    """Make ``path`` (``mode``) if it is missing, then refuse it unless only we can change it.

    Whoever can write a socket's directory can put their own socket in its place and read
    what clients send; in a shared /tmp another user can make the directory first. So the
    directory must be a real directory (not a link), owned by this process's user (or root),
    and writable by nobody else. Raises OSError saying what to fix.
    """
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode if directory == path else 0o755)
        except FileExistsError:
            continue  # made at the same moment by someone else: the checks below judge it
        os.chmod(directory, mode if directory == path else 0o755)  # exactly, whatever the umask
    info = os.lstat(path)
    fix = "remove it (as root if need be) and restart, or put the socket in a directory of your own"
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{what} {path} is not a directory but a link or a file, which someone may have put there "
                      f"to capture the socket; {fix}")
    if info.st_uid not in (os.geteuid(), 0):
        raise OSError(f"{what} {path} belongs to uid {info.st_uid}, not to sandboxd's user (uid {os.geteuid()}): "
                      f"its owner can replace the socket; {fix}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise OSError(f"{what} {path} is writable by its group or by others (mode {stat.S_IMODE(info.st_mode):04o}): "
                      f"they can replace the socket; `chmod go-w {path}` (or remove it) and restart")


def bind_unix_socket(path: Path, *, mode: int, group: str | None, backlog: int, in_use_hint: str) -> socket.socket:
    """Bind ``path`` with ``mode`` (and ``group``) from the first instant; replace a stale file.

    A file that still accepts connections belongs to a live server: that is an OSError
    ending with ``in_use_hint`` (what the operator should do), never a takeover.
    """
    secure_directory(path.parent, mode=0o755, what="the socket's directory")
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
