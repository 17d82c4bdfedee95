"""The API socket's mode and group are never wider than asked, not even between bind and chmod."""

from __future__ import annotations

import grp
import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest

from sandboxd import unixsocket
from sandboxd.unixsocket import bind_unix_socket

# A group that is not this process's: until the socket is chowned to it, the group bits
# name the wrong group, so they must be off.
OTHER_GROUP = next(g for g in grp.getgrall() if g.gr_gid != os.getegid())


@pytest.mark.parametrize("mode", [0o660, 0o600, 0o640])
def test_the_socket_is_never_wider_than_asked_at_any_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int) -> None:
    path = tmp_path / "run" / "s.sock"
    seen: list[tuple[str, int, int]] = []  # (step, permission bits, gid) of the socket file

    def look(step: str) -> None:
        info = os.stat(path)
        seen.append((step, stat.S_IMODE(info.st_mode), info.st_gid))

    class WatchedSocket(socket.socket):
        def bind(self, address: Any) -> None:
            super().bind(address)
            look("bind")

    real_chown, real_chmod = os.chown, os.chmod

    def chown(target: Any, uid: int, gid: int) -> None:
        if Path(target) == path:
            look("chown")
        real_chown(target, uid, gid)

    def chmod(target: Any, bits: int) -> None:
        if Path(target) == path:
            look("chmod")
        real_chmod(target, bits)

    monkeypatch.setattr(unixsocket.socket, "socket", WatchedSocket)
    monkeypatch.setattr(unixsocket.os, "chown", chown)
    monkeypatch.setattr(unixsocket.os, "chmod", chmod)
    old_umask = os.umask(0o000)  # the widest umask a daemon could inherit
    try:
        sock = bind_unix_socket(path, mode=mode, group=OTHER_GROUP.gr_name, backlog=1, in_use_hint="")
    finally:
        os.umask(old_umask)
    sock.close()
    look("done")
    assert [step for step, _, _ in seen][0] == "bind", seen  # watched from the instant the file exists
    for step, bits, gid in seen:
        assert bits & ~mode == 0, f"at {step} the socket had mode {bits:04o}, wider than {mode:04o}"
        if gid != OTHER_GROUP.gr_gid:
            assert bits & 0o077 == 0, f"at {step} the socket was open to group {gid}, not {OTHER_GROUP.gr_name}"
    assert seen[-1][1:] == (mode, OTHER_GROUP.gr_gid)


def test_a_live_socket_is_refused_and_left_in_place(tmp_path: Path) -> None:
    live = bind_unix_socket(tmp_path / "s.sock", mode=0o660, group=None, backlog=1, in_use_hint="stop the other one")
    try:
        with pytest.raises(OSError, match=r"something already listens on .*s\.sock; stop the other one"):
            bind_unix_socket(tmp_path / "s.sock", mode=0o660, group=None, backlog=1, in_use_hint="stop the other one")
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(tmp_path / "s.sock"))  # still the first server's
        probe.close()
    finally:
        live.close()


def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "s.sock"))
    stale.close()  # the file stays, nothing listens
    sock = bind_unix_socket(tmp_path / "s.sock", mode=0o660, group=None, backlog=1, in_use_hint="")
    sock.close()
