"""The daemon: startup → serve until told to stop → shutdown.

Shutdown is a fixed order with a bounded wait (see ``shutdown``).
"""

from __future__ import annotations

import asyncio
import grp
import hashlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from sandboxd import __version__
from sandboxd.config import Config
from sandboxd.errors import ShuttingDown
from sandboxd.logging import get_logger
from sandboxd.sandbox.backend import Backend, SandboxSpec
from sandboxd.sandbox.pool import Pool
from sandboxd.server.calls import CallContext, CallRunner
from sandboxd.server.connection import Connection
from sandboxd.tools.discovery import ToolCatalog
from sandboxd.tools.sync import sync_tools
from sandboxd.users import global_tools_dir, user_dir, user_tools_dir

log = get_logger("sandboxd.server")

MAINTENANCE_INTERVAL_S = 1.0


def instance_id(config: Config) -> str:
    """Names this daemon's containers, so a restart finds its own orphans and only those."""
    return hashlib.sha256(f"{config.socket}|{config.data_path}".encode()).hexdigest()[:12]


def make_backend(config: Config) -> Backend:
    max_line = config.calls.max_result_bytes * 2 + (64 << 10)
    if config.backend == "docker":
        from sandboxd.sandbox.docker_backend import DockerBackend

        return DockerBackend(config.sandbox, instance=instance_id(config), max_line_bytes=max_line)
    if config.backend == "process":
        from sandboxd.sandbox.process_backend import ProcessBackend

        return ProcessBackend(max_line_bytes=max_line)
    from sandboxd.sandbox.fake import FakeBackend

    return FakeBackend()


class Server:
    def __init__(self, config: Config, backend: Backend | None = None) -> None:
        self.config = config
        self.backend = backend or make_backend(config)
        self.catalog = ToolCatalog(config.data_path)
        self.pool = Pool(self.backend, config.pool, self.spec_for)
        self.runner = CallRunner(config, self.pool, self.backend)
        self.connections: set[Connection] = set()
        self.calls_in_flight: set[CallContext] = set()
        self.stopping = False
        self.started_at = time.monotonic()
        self._listener: asyncio.AbstractServer | None = None
        self._maintenance: asyncio.Task[None] | None = None
        self._orphans_removed = False
        self._orphan_warning_logged = False

    def spec_for(self, user: str) -> SandboxSpec:
        data = self.config.data_path
        email_db = Path(self.config.sandbox.email_db.format(data_path=data, user=user))
        return SandboxSpec(
            user=user,
            tools_dir=global_tools_dir(data),
            user_dir=user_dir(data, user),
            user_tools_dir=user_tools_dir(data, user),
            email_db=email_db,
        )

    # -- startup ---------------------------------------------------------------

    async def startup(self, listen_socket: socket.socket | None = None) -> None:
        cfg = self.config
        global_tools_dir(cfg.data_path).mkdir(parents=True, exist_ok=True)
        if cfg.seed_tools is not None:
            for action in sync_tools(cfg.seed_tools, global_tools_dir(cfg.data_path)):
                log.info("seed_sync", tool=action.name, action=action.action, version=action.seed_version)
        await self._remove_orphans()
        sock = listen_socket or self._bind_socket()
        self._listener = await asyncio.get_running_loop().create_unix_server(lambda: Connection(self), sock=sock)
        self._maintenance = asyncio.get_running_loop().create_task(self._maintain())
        log.info("listening", socket=str(cfg.socket), backend=self.backend.name, data_path=str(cfg.data_path), version=__version__)

    def _bind_socket(self) -> socket.socket:
        path = self.config.socket
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        if path.exists() or path.is_symlink():
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()  # stale, left by a daemon that died
            else:
                raise OSError(f"another sandboxd is already listening on {path}; stop it or pass --socket.")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Bind with a tight umask so there is no moment at which the socket is wider than configured.
        old_umask = os.umask(0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(old_umask)
        if self.config.socket_group:
            os.chown(path, -1, grp.getgrnam(self.config.socket_group).gr_gid)
        os.chmod(path, self.config.socket_mode)
        sock.listen(1024)
        sock.setblocking(False)
        return sock

    async def _remove_orphans(self) -> None:
        try:
            removed = await self.backend.remove_orphans()
        except Exception as exc:
            # Retried every maintenance tick until the engine answers; said once.
            if not self._orphan_warning_logged:
                log.warning("orphan_cleanup_deferred", error=str(exc))
                self._orphan_warning_logged = True
            return
        self._orphans_removed = True
        if removed:
            log.info("orphans_removed", count=removed)

    async def _maintain(self) -> None:
        while True:
            await asyncio.sleep(MAINTENANCE_INTERVAL_S)
            self.pool.maintain()
            if not self._orphans_removed:
                await self._remove_orphans()

    # -- status ----------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "version": __version__,
            "protocol": 1,
            "backend": self.backend.name,
            "unsandboxed": self.backend.name == "process",
            "uptimeS": round(time.monotonic() - self.started_at, 1),
            "stopping": self.stopping,
            "connections": len(self.connections),
            "callsInFlight": len(self.calls_in_flight),
            "calls": dict(self.runner.counts),
            "pool": self.pool.status(),
            "limits": {
                "maxPerUser": cfg.pool.max_per_user,
                "maxTotal": cfg.pool.max_total,
                "minIdle": cfg.pool.min_idle,
                "idleTtlS": cfg.pool.idle_ttl_s,
                "defaultTimeoutMs": cfg.calls.default_timeout_ms,
                "maxTimeoutMs": cfg.calls.max_timeout_ms,
            },
        }

    def shutting_down_error(self) -> ShuttingDown:
        return ShuttingDown("sandboxd is shutting down and takes no new calls; retry once it is back.")

    # -- shutdown --------------------------------------------------------------

    async def shutdown(self) -> None:
        self.stopping = True
        grace = self.config.pool.shutdown_grace_s
        log.info("shutting_down", calls_in_flight=len(self.calls_in_flight), grace_s=grace)
        # 1. Stop accepting connections, and remove the socket file so clients fail fast.
        if self._listener is not None:
            self._listener.close()
            try:
                self.config.socket.unlink()
            except FileNotFoundError:
                pass
        if self._maintenance is not None:
            self._maintenance.cancel()
        # 2. Let calls in flight finish, up to the grace period.
        deadline = time.monotonic() + grace
        while self.calls_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # 3. Cancel what is left: each answers `cancelled` and its sandbox is killed.
        for ctx in list(self.calls_in_flight):
            ctx.grace = 0.0
            ctx.cancel("sandboxd is shutting down")
        tasks = [ctx.task for ctx in self.calls_in_flight if ctx.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        # 4. Destroy every sandbox (busy ones were released by their calls above).
        await self.pool.close(grace=0)
        # 5. Close client connections, then the backend.
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        await self.backend.close()
        log.info("stopped")


async def serve(config: Config, backend: Backend | None = None, *, listen_socket: socket.socket | None = None,
                ready: Any = None) -> None:
    """Run until SIGTERM or SIGINT. ``ready`` is called once the socket listens."""
    server = Server(config, backend)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Installed for the whole run: a second signal during shutdown must not kill the
    # daemon half-way (its containers would be left behind); shutdown is bounded anyway.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.startup(listen_socket)
        if ready is not None:
            ready(server)
        await stop.wait()
        await server.shutdown()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
