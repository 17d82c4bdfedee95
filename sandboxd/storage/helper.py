"""sandboxd-quota: the one thing an unprivileged daemon needs root for, a user's folders under their quota.

Socket-activated (packaging/systemd/sandboxd-quota.socket, Accept=yes): systemd starts one
short instance per connection, with the connection as its stdin, and CAP_SYS_ADMIN (qgroups)
and CAP_CHOWN (the new folders go to the daemon) as its only capabilities. The request is a
user NAME, checked like the daemon checks it; the paths come from the configuration this
helper reads itself, never from the request, and are opened without following links
(storage/provision.py, provision_user). Only the daemon's uid is served (SO_PEERCRED); the limits
are the configuration's, not the caller's.

Protocol: one JSON line in, one out. ``{"op": "check"}`` → ``{"ok": true}``;
``{"op": "provision", "user": "alice@example.com"}`` → ``{"ok": true, "areas": {...}}``;
any problem → ``{"error": "..."}``.
"""

from __future__ import annotations

import argparse
import json
import pwd
import socket
import struct
import sys
from pathlib import Path
from typing import Any

from sandboxd.config import Config, load_config
from sandboxd.errors import ConfigError, InvalidParams
from sandboxd.storage.provision import provision_user
from sandboxd.users import check_user

MAX_REQUEST = 4096
READ_TIMEOUT_S = 5.0


def peer(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end, as the kernel saw it connect."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def handle(line: bytes, peer_uid: int, peer_gid: int, *, daemon_uid: int, config: Config) -> dict[str, Any]:
    """The answer to one request line from a peer with ``peer_uid``; only ``daemon_uid`` is served."""
    if peer_uid != daemon_uid:
        return {"error": f"uid {peer_uid} is not the sandboxd daemon's (uid {daemon_uid}); refused"}
    try:
        request = json.loads(line)
    except ValueError:
        return {"error": "the request is not a JSON line"}
    if not isinstance(request, dict) or set(request) - {"op", "user"}:
        return {"error": "the request must be {\"op\": \"check\"} or {\"op\": \"provision\", \"user\": NAME}"}
    op = request.get("op")
    if op == "check":
        return {"ok": True}
    if op != "provision":
        return {"error": f"unknown op {op!r}; the ops are check and provision"}
    name = request.get("user")
    try:
        user = check_user(name)
    except InvalidParams as exc:
        return {"error": exc.message}
    if user != name:  # the daemon sends names as it checked them: anything else is not from it
        return {"error": f"{name!r} is not a user name in its checked (lower-case) form"}
    try:
        areas = provision_user(config, user, (peer_uid, peer_gid))
    except (OSError, ValueError) as exc:
        return {"error": f"could not put {user}'s folders under their quota: {exc}"}
    return {"ok": True, "areas": areas}


def serve_connection(sock: socket.socket, *, daemon_uid: int, config: Config) -> None:
    _pid, uid, gid = peer(sock)
    sock.settimeout(READ_TIMEOUT_S)
    data = b""
    try:
        while b"\n" not in data and len(data) <= MAX_REQUEST:
            chunk = sock.recv(MAX_REQUEST)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        return
    if len(data) > MAX_REQUEST:
        answer: dict[str, Any] = {"error": f"the request is longer than {MAX_REQUEST} bytes"}
    else:
        answer = handle(data.split(b"\n", 1)[0], uid, gid, daemon_uid=daemon_uid, config=config)
    sock.sendall(json.dumps(answer).encode() + b"\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sandboxd-quota", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=None, help="sandboxd's configuration (default: as sandboxd)")
    parser.add_argument("--daemon-user", default="sandboxd", help="the account sandboxd runs as; only it is served")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
        daemon_uid = pwd.getpwnam(args.daemon_user).pw_uid
    except (ConfigError, KeyError) as exc:
        print(f"sandboxd-quota: {exc}", file=sys.stderr)
        return 2
    # Accept=yes: the accepted connection is stdin.
    with socket.socket(fileno=sys.stdin.fileno()) as sock:
        serve_connection(sock, daemon_uid=daemon_uid, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
