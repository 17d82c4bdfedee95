"""The daemon: startup → serve until told to stop → shutdown.

Shutdown is a fixed order with a bounded wait (see ``shutdown``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from sandboxd import __version__
from sandboxd.config import Config
from sandboxd.egress.proxy import EgressProxy
from sandboxd.errors import BackendUnavailable, ConfigError, InvalidParams
from sandboxd.logging import SUMMARY_INTERVAL_S, get_logger, log_dropped_summary, set_log_budget, set_log_level, source
from sandboxd.sandbox.backend import Backend, SandboxSpec
from sandboxd.sandbox.email_access import likely_owner, owner_access, owner_user
from sandboxd.sandbox.factory import make_backend, user_sandbox_spec
from sandboxd.sandbox.pool import Pool
from sandboxd.server.calls import CallRunner, Calls
from sandboxd.server.cluster_host import ClusterHost
from sandboxd.server.connection import Connection, RefusedPeers
from sandboxd.server.data_path import check_data_path_mount, lock_data_path
from sandboxd.server.lifecycle import Lifecycle
from sandboxd.server.orphans import OrphanSweep
from sandboxd.server.reload import config_change
from sandboxd.server.transfer import UserTransfer
from sandboxd.server.rpc import Later, Method
from sandboxd.server.tls_listener import TlsListener, start_cluster_listener
from sandboxd.server.watch import ToolWatch
from sandboxd.service import systemd
from sandboxd.service.fds import ClientShares, FdBudget, raise_nofile_limit
from sandboxd.service.metrics import Metrics
from sandboxd.service.peercred import PeerPolicy, peer_credentials
from sandboxd.storage.quota import Storage
from sandboxd.tools.discovery import ToolCatalog
from sandboxd.tools.sync import sync_tools
from sandboxd.tools.transpile_cache import TranspileCache, transpile_bin_dir
from sandboxd.unixsocket import bind_unix_socket
from sandboxd.users import check_user, global_tools_dir

log = get_logger("sandboxd.server")

MAINTENANCE_INTERVAL_S = 1.0
OVER_QUOTA_KILL = ("sandboxd: this user's folders went over their disk quota, so the call was stopped and their "
                   "sandboxes replaced; new calls are refused until they hold less. Delete files to free space.")
ACCEPTS_PER_TURN = 16  # clients accepted before the loop's other work gets a turn
CANCELLED_CALLS_WAIT_S = 5.0  # at shutdown, for the calls cancelled past the grace to answer


def instance_id(config: Config) -> str:
    """Names this daemon's containers, so a restart finds its own orphans and only those.

    A hash of the data path alone: a data path belongs to one daemon (it holds the path's
    lock: server/data_path.py), so a restart with another socket still finds what the last
    run left, and a daemon on another data path never touches them."""
    return hashlib.sha256(str(config.data_path.resolve()).encode()).hexdigest()[:12]


@dataclass
class _Held:
    """What start-up takes and shutdown gives back."""

    data_lock: int | None = None  # the fd holding the data path's lock (server/data_path.py)
    listener: socket.socket | None = None
    owns_socket_file: bool = True  # not when systemd passed the socket: it outlives this process
    tasks: list[asyncio.Task[None]] = field(default_factory=list)  # the maintenance tick and the tool watch
    # The transpile cache's start, held here only: shutdown stops the cache itself.
    transpile_start: asyncio.Task[None] | None = None


class Server:
    """The daemon's parts, built whole here; ``startup`` takes what a run holds, ``shutdown`` gives it back."""

    def __init__(self, config: Config, backend: Backend | None = None) -> None:
        self.config = config
        # Beside the API socket: a runtime directory the engine sees at the same path (unlike a service's private /tmp).
        self.backend = backend or make_backend(config, config.backend, instance=instance_id(config),
                                               shim_dir=config.socket.parent / f"{config.socket.name}.shims")
        # What a call goes through: its tools, the egress and disk policies, the pool of sandboxes, the runner.
        # The global tools transpiled on the host, refilled when a scan finds them changed.
        self.transpile_cache = TranspileCache(global_tools_dir(config.data_path), config.data_path)
        self.catalog = ToolCatalog(config.data_path, on_global_change=self.transpile_cache.request)
        # Sandboxes have no network of their own: this proxy, with its policy, is their way out.
        self.egress = EgressProxy(config.egress, browser_relay=config.integrations.relay)
        # Each user's disk quota, enforced by the kernel or measured; users with sandboxes are measured every second.
        self.storage = Storage(config, on_over=self._stop_writers, live_users=lambda: self.pool.status()["users"])
        self.pool = Pool(self.backend, config.pool, self.spec_for)
        self.metrics = Metrics(self)
        self.cluster = ClusterHost.of(config, self)  # with cluster:, the directory's gate on every call
        self.runner = CallRunner(config, self.pool, self.backend, storage=self.storage,
                                 on_call=self.metrics.observe_call, gate=self.cluster)
        self.stopping = False
        self.calls = Calls(self.runner, self.catalog, stopping=lambda: self.stopping)
        self.transfer = UserTransfer(lambda: self.config, self.calls.holds, self.cluster)  # users/export, import, move
        self.watch = ToolWatch(self.catalog)  # connections that asked to hear of tool changes
        # The edge: who may connect, and who is connected.
        self.peer_policy = PeerPolicy.from_config(config)
        self.connections: set[Connection] = set()
        self.refused_peers = RefusedPeers()  # answers, then closes, peers allowed_uids/allowed_gids refuse
        # Planned at start-up from RLIMIT_NOFILE (service/fds.py): what clients, and sandboxes, may hold.
        self.clients: ClientShares | None = None
        self.orphans = OrphanSweep(self.backend, config.data_path)
        self.cluster_listener: TlsListener | None = None  # cluster.listen's: other hosts, routers, operators
        self._held = _Held()
        self.started_at = time.monotonic()
        self._reloading = asyncio.Lock()

    @property
    def fd_budget(self) -> FdBudget | None:
        return None if self.clients is None else self.clients.budget

    @property
    def orphans_reaped(self) -> int:
        return self.orphans.reaped

    def spec_for(self, owner: str) -> SandboxSpec:
        """The spec of a sandbox of the pool's ``owner``: a user, and the email access its sandboxes carry."""
        return user_sandbox_spec(self.config, owner_user(owner), egress=self.egress,
                                 transpile_cache=self.transpile_cache.directory, provision=self.storage.provision,
                                 email_access=owner_access(owner))

    # -- startup ---------------------------------------------------------------

    async def startup(self, listen_socket: socket.socket | None = None) -> None:
        """In order, each step's failure stopping start-up before the next:

        1. The descriptor plan, first: a configuration the limit cannot hold stops start-up before it touches anything.
        2. The data path's lock, before the orphans: a second daemon here would take the first's sandboxes for them.
        3. The seed tools synced; the engine asked (a rootless or remote engine: one line now, not an error per
           call); the orphans removed; the transpile cache filled in the background.
        4. The disk quota: ``enforcement: hard`` that cannot be had stops start-up here; then, with ``cluster:``,
           the registration in the directory (an etcd that does not answer stops it too).
        5. The metrics endpoint and the cluster listener, before the socket: a bad address (or certificate) stops
           start-up with nothing to undo.
        6. The socket, then the maintenance tick and the tool watch.
        """
        cfg, held, loop = self.config, self._held, asyncio.get_running_loop()
        self._plan_fds()  # 1
        global_tools_dir(cfg.data_path).mkdir(parents=True, exist_ok=True)
        held.data_lock = lock_data_path(cfg.data_path)  # 2
        if cfg.seed_tools is not None:  # 3
            for action in sync_tools(cfg.seed_tools, global_tools_dir(cfg.data_path)):
                log.info("seed_sync", tool=action.name, action=action.action, version=action.seed_version)
        await self.check(cfg)
        await self.orphans.sweep()
        held.transpile_start = loop.create_task(self._start_transpile_cache())
        check_data_path_mount(cfg.data_path)
        await asyncio.to_thread(self.storage.resolve)  # 4
        await self.storage.start()
        if self.cluster is not None:  # registered in the directory before any call can arrive
            await self.cluster.start()
        if cfg.metrics.listen is not None:  # 5
            await self.metrics.start(cfg.metrics.listen, socket_group=cfg.socket_group)
        self.cluster_listener = start_cluster_listener(self, cfg.cluster, self.fd_budget)
        held.owns_socket_file = listen_socket is None  # 6
        sock = held.listener = listen_socket or self._bind_socket()
        sock.setblocking(False)
        loop.add_reader(sock.fileno(), self._accept)
        held.tasks += [loop.create_task(self._maintain()), loop.create_task(self.watch.run())]
        self._say_listening(sock.getsockname() or "(unnamed)", activated=listen_socket is not None)

    def _say_listening(self, address: str, *, activated: bool) -> None:
        cfg = self.config
        if address != str(cfg.socket):
            # Clients (and `sandboxd status`) look for `socket`; a mismatch means they will not find us.
            log.warning("socket_mismatch", listening=address, configured=str(cfg.socket),
                        hint="set `socket` to the ListenStream= path of sandboxd.socket")
        log.info("listening", socket=address, activated=activated, backend=self.backend.name,
                 data_path=str(cfg.data_path), version=__version__, image=cfg.sandbox.image,
                 peer_check=self.peer_policy.restricted,
                 event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0])
        if self.backend.name == "process":
            log.warning("UNSANDBOXED", backend="process",
                        detail="tools run as local node processes with this daemon's rights and see the host "
                               "filesystem; for development only, never for untrusted tools")

    def _plan_fds(self) -> None:
        soft, hard, limit = raise_nofile_limit()
        budget = FdBudget.plan(self.config, limit)  # ConfigError: exit 2, naming the keys
        self.clients = ClientShares(budget)
        log.info("fd_budget", limit=limit, soft_at_start=soft, hard=hard, reserved=budget.reserved,
                 per_sandbox=budget.per_sandbox, egress_connections=self.config.egress.max_connections,
                 sandboxes=budget.sandboxes, clients=budget.clients, per_client=budget.per_client)

    def _accept(self) -> None:
        """Accept what waits on the socket, ACCEPTS_PER_TURN at most (a flood of connects must not hold the
        loop). Each connection counts against its peer uid's share, past which it is refused, then closed
        unanswered; while every client descriptor is in use, accepting stops and newcomers wait in the backlog."""
        listener, clients = self._held.listener, self.clients
        assert listener is not None and clients is not None
        loop = asyncio.get_running_loop()
        for _ in range(ACCEPTS_PER_TURN):
            if clients.full:
                loop.remove_reader(listener.fileno())
                clients.when_room = lambda: loop.add_reader(listener.fileno(), self._accept)
                return
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # not for want of descriptors, which the budget keeps: said, then retried in 1 s
                log.warning("accept_failed", error=str(exc), budget=source("daemon", "accept"))
                loop.remove_reader(listener.fileno())
                loop.call_later(1, loop.add_reader, listener.fileno(), self._accept)
                return
            conn.setblocking(False)
            try:
                uid = peer_credentials(conn).uid
            except OSError:  # gone already
                conn.close()
                continue
            admission = clients.admit(uid)
            if admission == "drop":
                conn.close()  # a flood of them: closing is all the work it gets
                continue
            refusal = None
            if admission == "refuse":
                refusal = clients.refusal(uid)
                log.warning("client_over_share", uid=uid, per_client=clients.budget.per_client,
                            budget=source("peer", uid))
            loop.create_task(self._connect(conn, Connection(self, peer_uid=uid, refusal=refusal)))

    async def _connect(self, conn: socket.socket, connection: Connection) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: connection, conn)
        except OSError:
            self.closed(connection)
            conn.close()

    async def _start_transpile_cache(self) -> None:
        """Copy the image's esbuild out (once per version) and fill the cache, in the background:
        sandboxes started before it is ready start esbuild themselves, as without a cache."""
        try:
            esbuild = await self.backend.esbuild(transpile_bin_dir(self.config.data_path))
        except (BackendUnavailable, OSError) as exc:
            log.warning("transpile_cache_unavailable", error=str(exc),
                        detail="each sandbox transpiles the global tools itself (slower first calls)")
            return
        if esbuild is not None:
            self.transpile_cache.start(esbuild)

    def _bind_socket(self) -> socket.socket:
        return bind_unix_socket(
            self.config.socket, mode=self.config.socket_mode, group=self.config.socket_group, backlog=1024,
            in_use_hint="is another sandboxd running? Stop it or pass --socket.",
        )

    async def _maintain(self) -> None:
        summarized = time.monotonic()
        while True:
            await asyncio.sleep(MAINTENANCE_INTERVAL_S)
            self.pool.maintain()
            if not self.orphans.done:
                await self.orphans.sweep()
            if time.monotonic() - summarized >= SUMMARY_INTERVAL_S:
                summarized = time.monotonic()
                log_dropped_summary()  # one line for what the log's budgets dropped

    def _stop_writers(self, user: str) -> None:
        """``user`` was measured over quota (soft): no tool of theirs keeps writing past the refusal.
        Their running calls are ended and every sandbox of theirs that ran a tool is replaced."""
        killed = [ctx.kill(OVER_QUOTA_KILL) for ctx in list(self.calls.in_flight)
                  if ctx.sandbox is not None and ctx.sandbox.user == user]
        retired = self.pool.retire(user)
        if retired:
            log.warning("storage_over_quota_stopped", user=user, calls_ended=sum(killed), sandboxes=retired,
                        detail="over their disk quota: their sandboxes that ran a tool are replaced")

    # -- status ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "version": __version__,
            "protocol": 1,
            "backend": self.backend.name,
            "transport": self.backend.transport,
            "unsandboxed": self.backend.name == "process",
            "uptimeS": round(time.monotonic() - self.started_at, 1),
            "stopping": self.stopping,
            "connections": len(self.connections),
            "callsInFlight": len(self.calls.in_flight),
            "calls": dict(self.runner.counts),
            "pool": self.pool.status(),
            "storage": self.storage.status(),
            **({"cluster": self.cluster.status()} if self.cluster is not None else {}),
            "limits": {
                "maxPerUser": cfg.pool.max_per_user,
                "maxTotal": cfg.pool.max_total,
                "reserve": cfg.pool.reserved,
                "minIdle": cfg.pool.min_idle,
                "idleTtlS": cfg.pool.idle_ttl_s,
                "defaultTimeoutMs": cfg.calls.default_timeout_ms,
                "maxTimeoutMs": cfg.calls.max_timeout_ms,
                # Names only: a client (the pi extension) passes exactly these from its environment.
                "allowedEnv": list(cfg.calls.allowed_env),
            },
        }

    @property
    def egress_decisions(self) -> Mapping[tuple[str, str], int]:
        return self.egress.decisions

    @property
    def egress_secret_uses(self) -> Mapping[str, int]:
        return self.egress.secret_uses

    def describe(self) -> str:
        """One line for systemd's STATUS= (shown by `systemctl status sandboxd`)."""
        totals = self.pool.status()["totals"]
        state = "stopping" if self.stopping else f"serving on {self.config.socket}"
        calls = len(self.calls.in_flight)
        return (f"{state}: {calls} call{'s' * (calls != 1)} in flight, {totals['waiting']} queued; sandboxes "
                f"{totals['idle']} idle, {totals['busy']} busy, {totals['starting']} starting, {totals['stopping']} stopping")

    # -- the edge: what a connection may use (connection.Edge) --------------------

    @property
    def max_message_bytes(self) -> int:
        return self.config.max_message_bytes

    def refusal(self, sock: socket.socket) -> str | None:
        return self.peer_policy.refusal(sock)

    def opened(self, connection: Connection) -> None:
        self.connections.add(connection)

    def closed(self, connection: Connection) -> None:
        if connection.peer_uid is not None and self.clients is not None:
            self.clients.release(connection.peer_uid, "serve" if connection.refusal is None else "refuse")
            connection.peer_uid = None  # once
        self.connections.discard(connection)
        self.watch.forget(connection)

    def methods(self, connection: Connection) -> Mapping[str, Method]:
        return {"ping": lambda _id, _params: {}, "tools/list": self._list_tools,
                "tools/call": functools.partial(self.calls.start, connection.send),
                "tools/watch": lambda _id, params: Later(self.watch.watch(connection, connection.send, params)),
                "sandbox/status": lambda _id, _params: self.status(), **self.transfer.methods(connection)}

    def _list_tools(self, _id: Any, params: Any) -> Later:
        if params is not None and not isinstance(params, dict):
            raise InvalidParams("tools/list params must be an object like {\"user\": \"alice@example.com\"}.")
        user = params.get("user") if params is not None else None
        user = None if user is None else check_user(user)
        warm = user is not None and not self.stopping and (self.cluster is None or self.cluster.serves(user))

        async def listed() -> dict[str, Any]:
            tools = await self.catalog.tools_async(user)  # any scan runs in a worker thread
            if warm and user is not None:
                # A session lists its tools when it starts: its first call, seconds later, finds a warm sandbox,
                # of the email access most of its tools need (sandbox/email_access.py).
                self.pool.warm(likely_owner(user, (tool.permissions for tool in tools),
                                            self.config.tools.require_permissions))
            return {"tools": [tool.to_protocol() for tool in tools]}

        return Later(listed())

    # -- reload ------------------------------------------------------------------

    async def check(self, config: Config, *, engine: bool = True) -> None:
        """What start-up refuses, asked of ``config`` (ConfigError naming it and its fix): start-up and every reload
        call it, so a reload never applies what a restart would refuse. ``engine``: ask Docker too (the sandbox
        settings changed)."""
        if self.fd_budget is not None:  # the limit is the one start-up raised; the shares must still fit it
            FdBudget.plan(config, self.fd_budget.limit)
        if engine:
            await self.backend.preflight(config.sandbox)  # asks the engine in a worker thread

    async def reload(self, load: Callable[[], Config]) -> bool:
        """Re-read the configuration and apply what can change live; a bad file, or one start-up would
        refuse, keeps the old config. Reloads run one at a time (the check awaits the engine)."""
        async with self._reloading:
            try:
                new = load()
                change = config_change(self.config, new)
                await self.check(change.config, engine=change.touches("sandbox"))
            except ConfigError as exc:
                log.error("config_reload_failed", error=exc.message,
                          hint="the running configuration is unchanged; fix the file and reload again")
                return False
            self.apply_config(new)
            return True

    def _use(self, config: Config) -> None:
        """The one place a configuration reaches the owners that read it live."""
        self.config = self.runner.config = config
        self.pool.config = config.pool
        self.peer_policy = PeerPolicy.from_config(config)

    def apply_config(self, new: Config) -> tuple[list[str], list[str]]:
        """Swap in ``new`` except the keys that need a restart; returns (applied, needing a restart).

        Runs on the event loop, between callbacks, so no call sees half a change: the
        pool and the runner read their config afresh at every decision.
        """
        change = config_change(self.config, new)
        effective, applied, ignored = change.config, change.applied, change.needs_restart
        self._use(effective)
        if self.clients is not None:  # check() saw it fit; the clients' share follows
            self.clients.budget = FdBudget.plan(effective, self.clients.budget.limit)
        if "log_level" in applied:
            set_log_level(effective.log_level)
        if "log_rate" in applied or "log_burst" in applied:
            set_log_budget(effective.log_rate, effective.log_burst)
        if any(key.startswith("egress.") for key in applied):
            self.egress.reconfigure(effective.egress)  # from the next request on; open tunnels stay
        if "integrations.browser_relay" in applied:
            self.egress.browser_relay = effective.integrations.relay  # likewise
        if change.touches("sandbox"):
            self.backend.reconfigure(effective.sandbox)
            self.pool.retire_all()  # every later call runs under the new sandbox settings
        self.pool.maintain()  # new limits and min_idle take effect now, not at the next tick
        log.info("config_reloaded", applied=applied, needs_restart=ignored)
        if ignored:
            log.warning("config_needs_restart", keys=ignored, hint="restart sandboxd (systemctl restart sandboxd) to apply these")
        return applied, ignored

    # -- shutdown --------------------------------------------------------------

    async def shutdown(self) -> None:
        """In a fixed order, bounded by pool.shutdown_grace_s and CANCELLED_CALLS_WAIT_S:

        1. Stop accepting connections (the cluster listener's too), and remove the socket file so clients fail
           fast; stop the metrics endpoint, the maintenance tick and the tool watch.
        2. Let calls in flight finish, up to the grace period.
        3. Cancel what is left: each answers ``cancelled`` and its sandbox is killed.
        4. Destroy every sandbox (busy ones were released by their calls above).
        5. Close client connections, then the backend, the egress proxy, the tools, the quota, the data path's lock.
        """
        self.stopping = True
        grace = self.config.pool.shutdown_grace_s
        log.info("shutting_down", calls_in_flight=len(self.calls.in_flight), grace_s=grace)
        await self._stop_accepting()  # 1
        await self._drain(grace)  # 2, 3
        await self.pool.close(grace=0)  # 4
        await self._close()  # 5
        log_dropped_summary()
        log.info("stopped")

    async def _stop_accepting(self) -> None:
        held = self._held
        if held.listener is not None:
            asyncio.get_running_loop().remove_reader(held.listener.fileno())
            if self.clients is not None:
                self.clients.when_room = None
            held.listener.close()
            if held.owns_socket_file:
                self.config.socket.unlink(missing_ok=True)
        await self.metrics.close()
        if self.cluster_listener is not None:
            self.cluster_listener.close()
        for task in held.tasks:
            task.cancel()

    async def _drain(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while self.calls.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for ctx in list(self.calls.in_flight):
            ctx.cancel("sandboxd is shutting down", grace=0.0)
        tasks = [ctx.task for ctx in self.calls.in_flight if ctx.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=CANCELLED_CALLS_WAIT_S)

    async def _close(self) -> None:
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        await self.backend.close()
        self.egress.close()
        self.catalog.close()  # a scan still running in a worker is not waited for
        self.transpile_cache.stop()
        self.storage.close()
        if self.cluster is not None:  # the lease revoked: other hosts see this one gone now
            await self.cluster.stop()
        if self._held.data_lock is not None:
            os.close(self._held.data_lock)
            self._held.data_lock = None


async def serve(config: Config, backend: Backend | None = None, *, listen_socket: socket.socket | None = None,
                ready: Any = None, reload_config: Callable[[], Config] | None = None) -> None:
    """Run until SIGTERM or SIGINT; SIGHUP reloads via ``reload_config``. ``ready`` is called once the socket
    listens. Signals and systemd's notifications are the lifecycle's (server/lifecycle.py)."""
    server = Server(config, backend)
    run = Lifecycle(server, reload_config, systemd.Notifier.from_environ())
    with run.signals():
        await run.startup(listen_socket)
        if ready is not None:
            ready(server)
        await run.main_loop()
        await run.shutdown()
