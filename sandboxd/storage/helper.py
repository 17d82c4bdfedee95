"""sandboxd-quota: what an unprivileged daemon needs root for, a user's folders under their quota and a kill.

Socket-activated (packaging/systemd/sandboxd-quota.socket, Accept=yes): systemd starts one
short instance per connection, with the connection as its stdin, and CAP_SYS_ADMIN (qgroups),
CAP_CHOWN (the new folders go to the daemon) and CAP_KILL as its capabilities. The request is a
user NAME, checked like the daemon checks it; the paths come from the configuration this
helper reads itself, never from the request, and are opened without following links
(storage/provision.py, provision_user). Only the daemon's uid (``--daemon-user``) is served: the
peer's uid (SO_PEERCRED) is checked before a byte is read, and any other is refused at once.
The daemon's request line must arrive within READ_DEADLINE_S, trickled bytes or not, so a
silent peer cannot hold an instance (systemd allows 8 at once). The limits are the
configuration's, not the caller's; the configuration is read only once a request is in.

The daemon's second need for root: ending a condemned gVisor sandbox at once, by a SIGKILL to its
Sentry, which runs as another user (sandbox/docker/sentry.py says why the engine's kill is not
enough). The request names a container in full; the helper asks the engine whether it is a sandbox
of this configuration's daemon and which process is its Sentry, and signals only that process, only
in that container's cgroup (``kill_owned_sandbox``). A compromised daemon can so end its own
sandboxes and nothing else.

Protocol: one JSON line in, one out. ``{"op": "check"}`` → ``{"ok": true}``;
``{"op": "provision", "user": "alice@example.com"}`` → ``{"ok": true, "areas": {...}}``;
``{"op": "kill", "container": "<64 hex digits>"}`` → ``{"ok": true, "outcome": "killed"}`` (or gone,
not_its); any problem → ``{"error": "..."}``.
"""

from __future__ import annotations

import argparse
import json
import pwd
import socket
import struct
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandboxd.config import Config

MAX_REQUEST = 4096
# For the whole line: the daemon sends it as it connects, and an instance that waits longer holds
# one of the socket's 8 for a peer that may never send.
READ_DEADLINE_S = 0.5

Answer = dict[str, Any]
# Each op and the keys its request carries besides "op".
OPS = {"check": set(), "provision": {"user"}, "kill": {"container"}}
ENGINE_TIMEOUT_S = 10.0  # the kill's inspect: the daemon waits for this answer before it removes the sandbox


def peer(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end, as the kernel saw it connect."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def not_the_daemon(peer_uid: int, daemon_uid: int) -> Answer | None:
    if peer_uid == daemon_uid:
        return None
    return {"error": f"uid {peer_uid} is not the sandboxd daemon's (uid {daemon_uid}); refused"}


def handle(line: bytes, peer_uid: int, peer_gid: int, *, daemon_uid: int, config: Config) -> dict[str, Any]:
    """The answer to one request line from a peer with ``peer_uid``; only ``daemon_uid`` is served."""
    refused = not_the_daemon(peer_uid, daemon_uid)
    if refused is not None:
        return refused
    try:
        request = json.loads(line)
    except ValueError:
        return {"error": "the request is not a JSON line"}
    if not isinstance(request, dict):
        return {"error": 'the request must be an object: {"op": "check"}, {"op": "provision", "user": NAME} or '
                         '{"op": "kill", "container": ID}'}
    op = request.get("op")
    if not isinstance(op, str) or op not in OPS:
        return {"error": f"unknown op {op!r}; the ops are check, provision and kill"}
    if set(request) != {"op"} | OPS[op]:
        return {"error": f"op {op} must be sent with {sorted(OPS[op])} and nothing else, not {sorted(set(request) - {'op'})}"}
    if op == "check":
        return {"ok": True}
    if op == "kill":
        return _kill(request["container"], config)
    return _provision(request["user"], peer_uid, peer_gid, config)


def _kill(container: Any, config: Config) -> Answer:
    import docker

    from sandboxd.sandbox.docker.sentry import Refused, checked_container_id, kill_owned_sandbox

    engine = config.sandbox.docker_host or "unix:///var/run/docker.sock"
    if not engine.startswith("unix://"):
        return {"error": f"the Docker engine at {engine} is not on this host: its sandboxes' processes are not "
                         "this helper's to signal"}
    try:
        container_id = checked_container_id(container)  # before the engine is even asked
        api = docker.APIClient(base_url=engine, version="auto", timeout=ENGINE_TIMEOUT_S)
        return {"ok": True, "outcome": kill_owned_sandbox(api, container_id, config.data_path).value}
    except Refused as exc:
        return {"error": f"{exc}; refused"}
    except (docker.errors.DockerException, OSError) as exc:
        return {"error": f"the Docker engine at {engine} did not answer ({exc}); is it running?"}


def _provision(name: Any, peer_uid: int, peer_gid: int, config: Config) -> Answer:
    from sandboxd.errors import InvalidParams
    from sandboxd.storage.provision import provision_user
    from sandboxd.users import check_user

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


def read_request(sock: socket.socket) -> bytes | Answer:
    """The request line, read within READ_DEADLINE_S for the whole of it, or the answer that refuses it."""
    deadline = time.monotonic() + READ_DEADLINE_S
    data = b""
    try:
        while b"\n" not in data and len(data) <= MAX_REQUEST:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            chunk = sock.recv(MAX_REQUEST)
            if not chunk:
                break
            data += chunk
    except TimeoutError:
        return {"error": f"no whole request line within {READ_DEADLINE_S:g} s; refused"}
    if len(data) > MAX_REQUEST:
        return {"error": f"the request is longer than {MAX_REQUEST} bytes"}
    return data.split(b"\n", 1)[0]


def receive(sock: socket.socket, daemon_uid: int) -> tuple[bytes, int, int] | Answer:
    """(line, uid, gid) of the daemon's request, or the answer that ends the connection; a stranger's is never read."""
    _pid, uid, gid = peer(sock)
    refused = not_the_daemon(uid, daemon_uid)
    if refused is not None:
        return refused
    line = read_request(sock)
    return line if isinstance(line, dict) else (line, uid, gid)


def reply(sock: socket.socket, answer: Answer) -> None:
    sock.settimeout(READ_DEADLINE_S)  # one short line: a peer that does not read loses it, and holds nothing
    try:
        sock.sendall(json.dumps(answer).encode() + b"\n")
    except OSError:
        pass  # the peer is gone


def serve_connection(sock: socket.socket, *, daemon_uid: int, config: Config) -> None:
    got = receive(sock, daemon_uid)
    reply(sock, got if isinstance(got, dict) else handle(*got, daemon_uid=daemon_uid, config=config))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sandboxd-quota", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=None, help="sandboxd's configuration (default: as sandboxd)")
    parser.add_argument("--daemon-user", default="sandboxd", help="the account sandboxd runs as; only it is served")
    args = parser.parse_args(argv)
    try:
        daemon_uid = pwd.getpwnam(args.daemon_user).pw_uid
    except KeyError:
        print(f"sandboxd-quota: --daemon-user {args.daemon_user!r} is not a user here; give the account "
              "sandboxd.service runs as (User=)", file=sys.stderr)
        return 2
    # Accept=yes: the accepted connection is stdin. The peer is checked, and its line read, before the
    # configuration is: a refusal costs no import of it.
    with socket.socket(fileno=sys.stdin.fileno()) as sock:
        got = receive(sock, daemon_uid)
        if isinstance(got, dict):
            reply(sock, got)
            return 0
        from sandboxd.config import load_config
        from sandboxd.errors import ConfigError

        try:
            config = load_config(args.config)
        except ConfigError as exc:
            print(f"sandboxd-quota: {exc}", file=sys.stderr)
            reply(sock, {"error": f"the quota helper cannot read sandboxd's configuration: {exc}"})
            return 2
        reply(sock, handle(*got, daemon_uid=daemon_uid, config=config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
