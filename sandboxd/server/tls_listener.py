"""The cluster listener (``cluster.listen``): the daemon's JSON-RPC lines over TCP with mutual TLS.

Other hosts, routers and operators reach the daemon here (docs/security.md, "The cluster
listener"). A connection is the unix socket's ``Connection``, with an edge of its own
(``TlsPeer``): the certificate's role (cluster/tls.py) decides which methods answer and
which refuse (cluster/roles.py). Before the handshake completes a peer is nobody, so it
gets little: the handshake runs on the event loop (no thread), must end within
``HANDSHAKE_S``, and at most ``MAX_HANDSHAKES`` run at once, ``PER_ADDRESS`` of them from
one address; one that fails is closed without a byte of JSON and logged
``tls_peer_refused`` with its reason. Everything here, handshakes included, counts
against the listener's own share of the descriptors (``FdBudget.tls``), never against the
unix socket's clients.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from typing import Callable, Iterator, Mapping

from sandboxd.cluster.roles import may_call, refusing
from sandboxd.cluster.tls import Role, RoleRefused, role_of, server_context
from sandboxd.config.cluster import ClusterConfig
from sandboxd.hostport import parse_host_port
from sandboxd.logging import get_logger, source
from sandboxd.server.connection import Connection, Edge, RefusedPeers
from sandboxd.server.rpc import Method
from sandboxd.service.fds import FdBudget

log = get_logger("sandboxd.cluster")

HANDSHAKE_S = 5.0  # a peer that has not finished its handshake by then is closed
MAX_HANDSHAKES = 64  # in progress at once, every address together
PER_ADDRESS = 16  # in progress at once from one address: one peer cannot hold every slot
ACCEPTS_PER_TURN = 16  # as the unix socket's: a flood of connects must not hold the loop


class TlsShares:
    """The listener's descriptors: handshakes by address, then connections by certificate name.

    ``begin`` admits a handshake or refuses it (closed at once: the cheapest answer);
    ``settle`` turns a finished one into a connection, served unless its name holds ``per_name``
    already (then answered with a refusal). Everything counts against ``total`` until released;
    the listener stops accepting while it is ``full``."""

    def __init__(self, limit: int, per_name: int) -> None:
        self.limit, self.per_name = limit, per_name
        self.handshakes: collections.Counter[str] = collections.Counter()  # address → in progress
        self.served: collections.Counter[str] = collections.Counter()  # certificate name → connections
        self.refusing = 0
        self.when_room: Callable[[], None] | None = None  # called once, when a descriptor is free again

    @classmethod
    def from_budget(cls, budget: FdBudget) -> TlsShares:
        return cls(budget.tls, min(budget.per_client, budget.tls - MAX_HANDSHAKES))

    @property
    def total(self) -> int:
        return sum(self.handshakes.values()) + sum(self.served.values()) + self.refusing

    @property
    def full(self) -> bool:
        return self.total >= self.limit

    def begin(self, address: str) -> str | None:
        """Admit a handshake from ``address`` (None), or say why not."""
        if self.handshakes[address] >= PER_ADDRESS:
            return f"{PER_ADDRESS} handshakes from this address are in progress already"
        if sum(self.handshakes.values()) >= MAX_HANDSHAKES:
            return f"{MAX_HANDSHAKES} handshakes are in progress already"
        self.handshakes[address] += 1
        return None

    def end_handshake(self, address: str) -> None:
        """A handshake ``begin`` admitted failed, or was cut short."""
        _take(self.handshakes, address)
        self._room()

    def settle(self, address: str, name: str | None) -> bool:
        """The handshake from ``address`` is done: served as ``name`` (True), or refused (None, or over its share)."""
        _take(self.handshakes, address)
        if name is not None and self.served[name] < self.per_name:
            self.served[name] += 1
            return True
        self.refusing += 1
        return False

    def release(self, name: str | None) -> None:
        """A connection ``settle`` counted is closed (``name`` if it was served)."""
        if name is None:
            self.refusing -= 1
        else:
            _take(self.served, name)
        self._room()

    def _room(self) -> None:
        if self.when_room is not None and not self.full:
            resume, self.when_room = self.when_room, None
            resume()


def _take(counter: collections.Counter[str], key: str) -> None:
    counter[key] -= 1
    if counter[key] <= 0:
        del counter[key]


def handshake_failure(exc: BaseException) -> str:
    """Why a handshake failed, in words for the log."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"certificate refused: {exc.verify_message}"  # "unable to get local issuer certificate", "expired"
    reason = getattr(exc, "reason", None) if isinstance(exc, ssl.SSLError) else None
    known = {
        "PEER_DID_NOT_RETURN_A_CERTIFICATE": "no certificate",
        "TLSV1_ALERT_UNKNOWN_CA": "the peer does not trust this host's CA",
        "WRONG_VERSION_NUMBER": "not TLS (plain TCP?)",
        "HTTP_REQUEST": "not TLS (plain HTTP)",
        "UNSUPPORTED_PROTOCOL": "a TLS version older than 1.3",
        "NO_PROTOCOLS_AVAILABLE": "a TLS version older than 1.3",
    }
    if reason in known:
        return known[reason]
    if isinstance(exc, (asyncio.TimeoutError, ConnectionAbortedError)):
        return f"no handshake within {HANDSHAKE_S:g} s"
    return f"handshake failed ({type(exc).__name__}: {exc})"


class TlsPeer:
    """The edge of one TLS connection: its role, known once its handshake is done, and the methods it may call.

    ``Connection`` asks for the methods when it is made, before the handshake, so they are a view
    that asks the role at each request; it asks ``refusal`` once the handshake is done, which is
    where the role is read and the connection counted."""

    def __init__(self, listener: TlsListener, address: str) -> None:
        self._listener, self.address = listener, address
        self.refused_peers: RefusedPeers = listener.host.refused_peers
        self.role: Role | None = None
        self.counted_as: str | None = None  # the name it is served as; None: refusing
        self._connection: Connection | None = None
        self._state = "handshake"  # → "counted" → "released"

    @property
    def max_message_bytes(self) -> int:
        return self._listener.host.max_message_bytes

    def methods(self, connection: Connection) -> Mapping[str, Method]:
        self._connection = connection
        return RoleMethods(self._listener.host.methods(connection), self)

    def refusal(self, _sock: socket.socket) -> str | None:
        assert self._connection is not None and self._connection.transport is not None
        transport = self._connection.transport
        self._state = "counted"
        try:
            role = role_of(transport.get_extra_info("peercert"))
        except RoleRefused as exc:
            self._listener.shares.settle(self.address, None)
            self._listener.refused(self.address, f"bad role: {exc}")
            return (f"this certificate names no role ({exc}): the cluster listener lets in node:NAME, router:NAME "
                    "and operator:NAME certificates its CA signed (docs/install.md, \"Certificates\")")
        if not self._listener.shares.settle(self.address, str(role)):
            self._listener.refused(self.address, f"{role} holds {self._listener.shares.per_name} connections already")
            return (f"{role} already holds {self._listener.shares.per_name} connections to this host, its share of the "
                    "daemon's file descriptors; close idle ones (the operator can raise max_client_connections)")
        self.role, self.counted_as = role, str(role)
        return None

    def opened(self, connection: Connection) -> None:
        log.info("tls_peer", address=self.address, role=str(self.role), budget=source("tls", self.address))
        self._listener.host.opened(connection)

    def closed(self, connection: Connection) -> None:
        self._release()
        self._listener.host.closed(connection)

    def handshake_failed(self) -> bool:
        """The handshake did not finish: True if it still counted as one (now released)."""
        failed = self._state == "handshake"
        self._release()
        return failed

    def _release(self) -> None:
        """Once, whichever way the connection ends: what it counts as is given back."""
        if self._state == "handshake":
            self._listener.shares.end_handshake(self.address)
        elif self._state == "counted":
            self._listener.shares.release(self.counted_as)
        self._state = "released"


class RoleMethods(Mapping[str, Method]):
    """The daemon's methods as ``peer``'s role sees them: one it may not call answers its refusal."""

    def __init__(self, methods: Mapping[str, Method], peer: TlsPeer) -> None:
        self._methods, self._peer = methods, peer

    def __getitem__(self, name: str) -> Method:
        method, role = self._methods[name], self._peer.role
        if role is None:  # never: a connection without a role is refused before any request is read
            raise KeyError(name)
        return method if may_call(role, name) else refusing(role, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._methods)

    def __len__(self) -> int:
        return len(self._methods)


class TlsListener:
    """Accepts on ``cluster.listen``; every connection a ``Connection`` whose edge is a ``TlsPeer`` of ``host``."""

    def __init__(self, host: Edge, cluster: ClusterConfig, budget: FdBudget) -> None:
        assert cluster.listen is not None
        self.host = host
        self.context = server_context(cluster.tls)  # ConfigError: a certificate, key or CA that cannot be read
        self.shares = TlsShares.from_budget(budget)
        self.address = cluster.listen
        self._sock: socket.socket | None = None
        self._handshaking: set[asyncio.Task[None]] = set()

    def start(self) -> tuple[str, int]:
        """Bind and listen (OSError: the address is taken or not this host's); the address bound."""
        ip, port = parse_host_port(self.address, example="'0.0.0.0:7443'")
        sock = socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart binds again at once
            sock.bind((str(ip), port))
            sock.listen(1024)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)
        bound: tuple[str, int] = sock.getsockname()[:2]
        log.info("cluster_listening", address=f"{bound[0]}:{bound[1]}", tls="1.3, mutual",
                 handshake_s=HANDSHAKE_S, descriptors=self.shares.limit, per_name=self.shares.per_name)
        return bound

    def close(self) -> None:
        """Stop accepting, and drop the handshakes in progress (served connections are the host's to close)."""
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self.shares.when_room = None
            self._sock.close()
            self._sock = None
        for task in self._handshaking:
            task.cancel()

    def refused(self, address: str, reason: str) -> None:
        log.warning("tls_peer_refused", address=address, reason=reason, budget=source("tls", address))

    def _accept(self) -> None:
        sock, shares, loop = self._sock, self.shares, asyncio.get_running_loop()
        assert sock is not None
        for _ in range(ACCEPTS_PER_TURN):
            if shares.full:  # newcomers wait in the backlog until a descriptor is free
                loop.remove_reader(sock.fileno())
                shares.when_room = self._resume
                return
            try:
                conn, peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept_failed", error=str(exc), budget=source("daemon", "cluster_accept"))
                loop.remove_reader(sock.fileno())
                loop.call_later(1, self._resume)
                return
            address = peer[0]
            why = shares.begin(address)
            if why is not None:
                conn.close()
                self.refused(address, why)
                continue
            task = loop.create_task(self._handshake(conn, address))
            self._handshaking.add(task)
            task.add_done_callback(self._handshaking.discard)

    def _resume(self) -> None:
        if self._sock is not None:  # not closed meanwhile
            asyncio.get_running_loop().add_reader(self._sock.fileno(), self._accept)

    async def _handshake(self, conn: socket.socket, address: str) -> None:
        peer = TlsPeer(self, address)
        connection = Connection(peer)
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: connection, conn, ssl=self.context, ssl_handshake_timeout=HANDSHAKE_S)
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if peer.handshake_failed():
                conn.close()
                if not isinstance(exc, asyncio.CancelledError):
                    self.refused(address, handshake_failure(exc))


def start_cluster_listener(host: Edge, cluster: ClusterConfig | None, budget: FdBudget | None) -> TlsListener | None:
    """The listener of ``cluster.listen``, listening; None without one. ConfigError or OSError stop start-up."""
    if cluster is None or cluster.listen is None:
        return None
    assert budget is not None  # planned first (Server.startup's step 1)
    listener = TlsListener(host, cluster, budget)
    listener.start()
    return listener
