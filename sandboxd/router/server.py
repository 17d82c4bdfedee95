"""The router: a unix socket with the daemon's rules (server/connection.py), every call forwarded to its
user's host (forward.py), ``ping`` and ``sandbox/status`` answered for the fleet (fleet.py).

It holds nothing but the directory's view and its connections to the hosts, so any number
of routers run side by side (docs/scale.md, "The router").
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from typing import Any, Mapping, cast

import orjson

from sandboxd.config import Config
from sandboxd.errors import InvalidParams
from sandboxd.logging import get_logger
from sandboxd.router import fleet
from sandboxd.router.forward import Answered, Forward, Hosts, NotSent, Sending, routed, send
from sandboxd.router.ids import Verbatim, client_token, with_token
from sandboxd.cluster.rendezvous import weight
from sandboxd.router.routing import Directory, no_host
from sandboxd.router.upstream import Dial, HostUnreachable, UpstreamConnection, UpstreamLost
from sandboxd.router.watch import Watches, watched_user
from sandboxd.server.connection import Connection, RefusedPeers
from sandboxd.server.rpc import Later, Method
from sandboxd.service.fds import raise_nofile_limit
from sandboxd.service.peercred import PeerPolicy
from sandboxd.unixsocket import bind_unix_socket
from sandboxd.users import check_user
from sandboxd.wire import PROGRESS, TOOLS_LIST_CHANGED, notification

log = get_logger("sandboxd.router")

MAX_CLIENTS = 4096  # connections served at once; more are refused (each holds a descriptor)
# A client's unread output past which it is disconnected (its calls cancelled): a host's connection is shared, so
# the router cannot pause a call's progress for one client that stopped reading, as a daemon pauses its sandbox.
MAX_UNREAD = 64 << 20
RESERVED_FDS = 128  # kept from the client connections: the hosts' pools, etcd, the refused peers held a moment
SLACK_S = 5.0  # past a call's deadline, its grace and its queueing, before a silent host's call is given up


def _params(params: Any, method: str) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise InvalidParams(f"{method} params must be an object like {{\"user\": \"alice@example.com\", ...}}.")
    return params


def _result(answer: dict[str, Any] | Verbatim) -> dict[str, Any]:
    """A host's answer as the client's: its result, or its error raised to be passed on as it came. A verbatim
    result goes into the client's answer as the host wrote it (orjson writes a Fragment's bytes as they are)."""
    if isinstance(answer, Verbatim):
        return cast(dict[str, Any], orjson.Fragment(answer.result))
    error = answer.get("error")
    if isinstance(error, dict):
        raise Answered(error)
    result = answer.get("result")
    return result if isinstance(result, dict) else {}


def _rewrite(params: Any, upstream_id: int) -> Any:
    return with_token(params, upstream_id) or params


class Router:
    def __init__(self, config: Config, view: Directory, dial: Dial, *, max_clients: int = MAX_CLIENTS) -> None:
        self.config, self.view = config, view
        self.max_clients = max_clients  # past it a connection is answered -32003 and closed, not left to EMFILE
        self.max_unread = MAX_UNREAD
        self.hosts = Hosts(dial, self._notified, self._lost)
        self.watches = Watches()
        self.asking = fleet.Asking(view, self.hosts)  # ping and sandbox/status: one ask of the fleet at a time
        self.peer_policy = PeerPolicy.from_config(config)
        self.refused_peers = RefusedPeers()
        self.connections: set[Connection] = set()
        self.forwarding: set[Forward] = set()  # the calls on their way, cancelled at shutdown
        self.started_at = time.monotonic()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    # -- listening -----------------------------------------------------------------

    async def start(self, listen_socket: socket.socket | None = None) -> None:
        sock = listen_socket or bind_unix_socket(
            self.config.socket, mode=self.config.socket_mode, group=self.config.socket_group, backlog=1024,
            in_use_hint="is another router or sandboxd listening there? Stop it or pass --socket.")
        self._server = await asyncio.get_running_loop().create_unix_server(self._connection, sock=sock)
        log.info("router_listening", socket=str(self.config.socket), hosts=sorted(self.view.nodes()),
                 peer_check=self.peer_policy.restricted)

    def _connection(self) -> Connection:
        if len(self.connections) >= self.max_clients:
            return Connection(self, refusal=f"the router serves {self.max_clients} connections at once; close idle "
                                            "ones, or run another router beside it.")
        return Connection(self)

    @property
    def in_flight(self) -> int:
        return len(self.forwarding)

    async def close(self) -> None:
        """Stop listening; cancel the calls on their way (each answers ``cancelled``, as a daemon's shutdown
        answers them), waiting up to the cancel grace and ``SLACK_S``; then close every connection."""
        if self._server is not None:
            self._server.close()
            self.config.socket.unlink(missing_ok=True)
        for forward in list(self.forwarding):
            forward.cancel("the router is shutting down")
        deadline = time.monotonic() + self.config.calls.cancel_grace_ms / 1000 + SLACK_S
        while self.forwarding and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0)  # the last answers' writes
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        self.hosts.close()
        for task in self._tasks:
            task.cancel()

    # -- the edge (server/connection.py's Edge) -----------------------------------------

    @property
    def max_message_bytes(self) -> int:
        return self.config.max_message_bytes

    def refusal(self, sock: socket.socket) -> str | None:
        return self.peer_policy.refusal(sock)

    def opened(self, connection: Connection) -> None:
        self.connections.add(connection)

    def closed(self, connection: Connection) -> None:
        self.connections.discard(connection)
        self.watches.forget(connection)

    def methods(self, connection: Connection) -> Mapping[str, Method]:
        return {"ping": lambda _id, _params: Later(fleet.ping(self.asking)),
                "tools/list": self._list,
                "tools/call": lambda request_id, params: self._call(connection, request_id, params),
                "tools/watch": lambda _id, params: Later(self._watch(connection, params)),
                "sandbox/status": lambda _id, _params: Later(fleet.status(
                    self.config, self.asking, connections=len(self.connections), in_flight=self.in_flight,
                    started_at=self.started_at))}

    # -- methods ---------------------------------------------------------------------

    def _deadlines(self, params: dict[str, Any]) -> tuple[float, float]:
        """(the call's own deadline, how long its host may take to answer), in seconds."""
        calls = self.config.calls
        asked = params.get("timeoutMs")
        timeout_ms = (min(asked, calls.max_timeout_ms) if isinstance(asked, (int, float)) and not isinstance(asked, bool)
                      and asked > 0 else calls.default_timeout_ms)
        wait_ms = timeout_ms + calls.cancel_grace_ms + self.config.pool.acquire_timeout_ms
        return timeout_ms / 1000, wait_ms / 1000 + SLACK_S

    def _call(self, connection: Connection, request_id: Any, params: Any) -> Later:
        params = _params(params, "tools/call")
        user = check_user(params.get("user"))
        deadline_s, wait_s = self._deadlines(params)
        forward = Forward()
        sending = Sending("tools/call", params, deadline_s=deadline_s, wait_s=wait_s, forward=forward,
                          on_progress=lambda progress: self._progress(connection, progress),
                          client_token=client_token(params, request_id), rewrite=_rewrite, verbatim=True)
        return Later(self._forwarded(user, sending), forward)

    def _progress(self, connection: Connection, progress: dict[str, Any]) -> None:
        transport = connection.transport
        if transport is not None and transport.get_write_buffer_size() > self.max_unread:
            log.warning("router_client_not_reading", unread=transport.get_write_buffer_size(),
                        limit=self.max_unread, detail="disconnected: its calls are cancelled")
            transport.abort()  # connection_lost follows: the disconnect cancels the client's calls at their hosts
            return
        connection.send(notification(PROGRESS, progress))

    async def _forwarded(self, user: str, sending: Sending) -> dict[str, Any]:
        self.forwarding.add(sending.forward)
        started = time.monotonic()
        try:
            return _result(await routed(user, sending, self.view, self.hosts))
        except NotSent as cancelled:
            return {"content": [{"type": "text", "text": f"cancelled before it reached a host: {cancelled}"}],
                    "isError": True, "status": "cancelled", "durationMs": round((time.monotonic() - started) * 1000)}
        finally:
            self.forwarding.discard(sending.forward)

    def _list(self, _id: Any, params: Any) -> Later:
        if params is not None:
            params = _params(params, "tools/list")
        user = None if params is None or params.get("user") is None else check_user(params.get("user"))
        deadline_s, wait_s = self._deadlines({})
        sending = Sending("tools/list", params, deadline_s=deadline_s, wait_s=wait_s)
        if user is None:
            return Later(self._on_any_host(sending))
        return Later(self._routed_result(user, sending))

    async def _routed_result(self, user: str, sending: Sending) -> dict[str, Any]:
        return _result(await routed(user, sending, self.view, self.hosts))

    async def _on_any_host(self, sending: Sending) -> dict[str, Any]:
        """For what every host answers alike (the global tools): the first that answers, in a fixed order
        per method (so one host's cache stays warm), the next one when a host cannot be reached."""
        active = sorted((host for host in self.view.nodes().values() if host.state == "active" and host.address),
                        key=lambda host: weight(sending.method, host.name), reverse=True)
        for host in active:
            assert host.address is not None
            try:
                return _result(await send(self.hosts.get(host.name, host.address), sending))
            except (HostUnreachable, UpstreamLost):
                continue  # a listing is read-only: asking the next host is safe
        raise no_host()

    async def _watch(self, connection: Connection, params: Any) -> dict[str, Any]:
        user = watched_user(params)
        if self.watches.add(connection, connection.send, user):
            await self._watch_at_host(user)
        return {}

    async def _watch_at_host(self, user: str | None) -> None:
        deadline_s, wait_s = self._deadlines({})
        sending = Sending("tools/watch", {} if user is None else {"user": user}, deadline_s=deadline_s,
                          wait_s=wait_s, to_watch=True)
        if user is None:
            await self._on_any_host(sending)
        else:
            _result(await routed(user, sending, self.view, self.hosts))
        conn = sending.forward.last
        if conn is not None and user not in self.watches.at_hosts:
            conn.watching += 1
            self.watches.held(user, conn.node, conn)

    # -- what the hosts send besides answers ---------------------------------------------------

    def _notified(self, node: str, message: dict[str, Any]) -> None:
        if message.get("method") == TOOLS_LIST_CHANGED:
            self.watches.changed(node, message.get("params"))

    def _lost(self, conn: UpstreamConnection) -> None:
        for user in self.watches.lost(conn):
            task = asyncio.get_running_loop().create_task(self._rewatch(user))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _rewatch(self, user: str | None) -> None:
        try:
            await self._watch_at_host(user)
        except Exception as exc:  # the host is down or the user moving: the watchers were told to list again
            log.warning("router_rewatch_failed", user=user, error=str(exc))


async def serve(config: Config, view: Directory, dial: Dial, *, ready: Any = None) -> None:
    """Run the router until SIGTERM or SIGINT."""
    _, _, limit = raise_nofile_limit()  # the router's descriptors are its clients': all of the hard limit
    router = Router(config, view, dial, max_clients=max(16, min(MAX_CLIENTS, limit - RESERVED_FDS)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await router.start()
    if ready is not None:
        ready(router)
    try:
        await stop.wait()
    finally:
        log.info("router_stopping", calls_in_flight=router.in_flight)
        await router.close()
