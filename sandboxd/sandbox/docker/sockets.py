"""The sockets of one Docker sandbox, in a directory only that sandbox mounts.

The parent directory is the daemon's own (0700), so on the host only root and the daemon's
user can reach them. ``shim.sock``: the shim connects once, before any tool code runs, and
the listener is gone after that one connection, which must come from the sandbox itself
(``SandboxPeer``), or the start fails. ``egress.sock`` (when the sandbox has a way out)
stays for the sandbox's life, served by its proxy session (egress/proxy.py), which admits
only the same peer.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from sandboxd.egress.contract import EgressSession
from sandboxd.errors import BackendUnavailable
from sandboxd.sandbox.docker.spec import EGRESS_SOCKET_NAME, HOSTS_NAME, LOOPBACK_HOSTS, SHIM_SOCKET_NAME
from sandboxd.service.peercred import PeerCredentials, peer_credentials


CGROUP_ROOT = Path("/sys/fs/cgroup")
# A container's member list, by the engine's cgroupfs and systemd drivers: cgroup v1's pids hierarchy, then v2.
PROCS_FILES = ("pids/docker/{id}/cgroup.procs", "pids/system.slice/docker-{id}.scope/cgroup.procs",
               "docker/{id}/cgroup.procs", "system.slice/docker-{id}.scope/cgroup.procs")


def in_container_cgroup(pid: int, container_id: str, root: Path = CGROUP_ROOT) -> bool:
    """Whether process ``pid`` of this host is in the cgroup of container ``container_id``
    (cgroupfs: .../docker/<id>; the systemd driver: .../docker-<id>.scope), in any hierarchy.

    Where /proc hides the process (the unit's ProtectProc=invisible hides runsc's, which are root's and
    nobody's, from the unprivileged daemon), the container's own member list answers instead."""
    try:
        with open(f"/proc/{pid}/cgroup") as lines:
            paths = [line.rstrip("\n").split(":", 2)[2] for line in lines if line.count(":") >= 2]
    except OSError:  # gone already, or hidden
        return in_container_procs(pid, container_id, root)
    return any(path.rsplit("/", 1)[-1] in (container_id, f"docker-{container_id}.scope") for path in paths)


def in_container_procs(pid: int, container_id: str, root: Path = CGROUP_ROOT) -> bool:
    """Whether ``pid`` is in the member list (cgroup.procs) of container ``container_id``'s cgroup."""
    for pattern in PROCS_FILES:
        try:
            members = (root / pattern.format(id=container_id)).read_text().split()
        except OSError:  # another driver or cgroup version, or the container is gone
            continue
        return str(pid) in members
    return False


@dataclass(frozen=True)
class SandboxPeer:
    """How the daemon knows that a connection to a sandbox's socket comes from that sandbox.

    runc: the kernel's record of the connecting process (SO_PEERCRED) carries the sandbox's
    uid, which no process of the host has (the directory is not even reachable by others).
    gVisor: the sandbox's own kernel makes the connection on the host through runsc's gofer,
    a root process of the host; it is that container's if it lives in the container's cgroup,
    where only the engine puts processes. Under runc the uid check alone applies, as before.
    """

    uid: int
    gvisor: bool = False

    def problem(self, peer: PeerCredentials, container_id: str) -> str | None:
        """Why ``peer`` is not the sandbox of ``container_id``, or None."""
        if self.gvisor:
            if peer.uid == 0 and in_container_cgroup(peer.pid, container_id):
                return None
            return (f"pid {peer.pid}, uid {peer.uid}, is not runsc's process of the sandbox's container "
                    f"{container_id[:12]} (gVisor)")
        if peer.uid == self.uid:
            return None
        return f"pid {peer.pid}, uid {peer.uid}; the sandbox runs as {self.uid}"


class SandboxSockets:
    def __init__(self, parent: Path, instance: str, peer: SandboxPeer, *, egress: bool = False) -> None:
        self.peer = peer
        self.dir = parent / f"{instance[:12]}-{secrets.token_hex(6)}"
        self.dir.mkdir(mode=0o755)
        os.chmod(self.dir, 0o755)  # the sandbox's user must traverse it (umask aside)
        self.sock: socket.socket | None = None
        self.egress: socket.socket | None = None
        self._egress_session: EgressSession | None = None
        self._egress_accept: asyncio.Task[None] | None = None
        try:
            (self.dir / HOSTS_NAME).write_text(LOOPBACK_HOSTS)  # mounted at /etc/hosts (spec.py)
            os.chmod(self.dir / HOSTS_NAME, 0o644)
            self.sock = self._bind(SHIM_SOCKET_NAME, backlog=1)
            if egress:
                self.egress = self._bind(EGRESS_SOCKET_NAME, backlog=64)
        except BaseException:
            self.close()
            self.remove()
            raise

    def _bind(self, name: str, backlog: int) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Through the directory's fd: a socket path longer than 108 bytes still binds.
            dir_fd = os.open(self.dir, os.O_PATH | os.O_DIRECTORY)
            try:
                sock.bind(f"/proc/self/fd/{dir_fd}/{name}")
            finally:
                os.close(dir_fd)
            os.chmod(self.dir / name, 0o666)  # the sandbox's uid may differ from ours
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    async def accept(self, container_id: str) -> socket.socket:
        """The shim's one connection; BackendUnavailable when another process made it."""
        assert self.sock is not None
        conn, _ = await asyncio.get_running_loop().sock_accept(self.sock)
        problem = self.peer.problem(peer_credentials(conn), container_id)
        if problem is not None:
            conn.close()
            raise BackendUnavailable(
                f"a process that is not the sandbox's shim ({problem}) connected to its socket "
                f"{self.dir / SHIM_SOCKET_NAME}; the sandbox was not used"
            )
        return conn

    def serve_egress(self, session: EgressSession, container_id: str) -> None:
        """Hand each connection to ``egress.sock`` to the proxy's session for this sandbox, until ``remove``."""
        assert self.egress is not None
        self._egress_session = session
        self._egress_accept = asyncio.get_running_loop().create_task(
            session.serve(self.egress, lambda peer: self.peer.problem(peer, container_id) is None))

    def close(self) -> None:
        """Stop listening for the shim and remove its socket (the sandbox keeps its open connection);
        the directory goes too unless egress is served from it."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            try:
                os.unlink(self.dir / SHIM_SOCKET_NAME)
            except OSError:
                pass
        if self.egress is None:
            self.remove()

    def remove(self) -> None:
        """End the sandbox's way out (no new connections, the open ones closed) and remove the
        directory with what is left in it: the sandbox is gone."""
        if self._egress_accept is not None:
            self._egress_accept.cancel()
            self._egress_accept = None
        if self._egress_session is not None:
            self._egress_session.close()
            self._egress_session = None
        if self.egress is not None:
            self.egress.close()
        shutil.rmtree(self.dir, ignore_errors=True)
