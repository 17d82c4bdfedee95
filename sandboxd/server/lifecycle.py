"""The daemon's run, read as uvicorn's: start-up, main loop, shutdown; signals and systemd around them.

SIGTERM and SIGINT end the main loop, and SIGHUP reloads the configuration meanwhile. Under
systemd (Type=notify) the run reports READY=1 once the socket listens, RELOADING=1 and READY=1
around a reload, and STOPPING=1 at shutdown. It feeds the watchdog when WatchdogSec= is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from typing import Callable, Iterator, Protocol

from sandboxd.config import Config
from sandboxd.logging import get_logger
from sandboxd.server.calls import Calls
from sandboxd.service import systemd

log = get_logger("sandboxd.server")

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Daemon(Protocol):
    """What a run starts, reloads and stops (``server.Server`` is one)."""

    calls: Calls

    async def startup(self, listen_socket: socket.socket | None = None) -> None: ...

    async def reload(self, load: Callable[[], Config]) -> bool: ...

    async def shutdown(self) -> None: ...

    def describe(self) -> str:
        """One line for systemd's STATUS=."""


class Lifecycle:
    """One run of ``daemon``: its signal handlers, its systemd notifier and the watchdog feeder."""

    def __init__(self, daemon: Daemon, reload_config: Callable[[], Config] | None,
                 notifier: systemd.Notifier) -> None:
        self._daemon = daemon
        self._reload_config = reload_config
        self._notifier = notifier
        self._stop = asyncio.Event()
        self._reloads: set[asyncio.Task[None]] = set()
        self._supervisor: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def signals(self) -> Iterator[None]:
        """The signal handlers for the whole run; on the way out, systemd's side closed too, whatever happened.

        A second signal during shutdown must not kill the daemon half-way (its containers would be
        left behind), so the handlers stay until shutdown is done; shutdown is bounded anyway.
        """
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._hangup)  # unhandled, SIGHUP would kill the daemon
        try:
            yield
        finally:
            if self._supervisor is not None:
                self._supervisor.cancel()
            self._notifier.close()
            for sig in (*_STOP_SIGNALS, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    async def startup(self, listen_socket: socket.socket | None) -> None:
        """The daemon started and listening, then READY=1; the watchdog fed from then on."""
        notifier = self._notifier
        notifier.status("starting: syncing seed tools, removing orphaned sandboxes")
        await self._daemon.startup(listen_socket)
        notifier.ready(self._daemon.describe())
        if notifier.enabled:
            self._supervisor = asyncio.get_running_loop().create_task(
                systemd.supervise(notifier, self._daemon.describe, systemd.watchdog_interval()))

    async def main_loop(self) -> None:
        """Until SIGTERM or SIGINT; the daemon's own tasks and the reloads run meanwhile."""
        await self._stop.wait()

    async def shutdown(self) -> None:
        """STOPPING=1, then the daemon's shutdown (its fixed order, bounded by pool.shutdown_grace_s)."""
        self._notifier.stopping(f"stopping: letting {len(self._daemon.calls.in_flight)} calls finish")
        await self._daemon.shutdown()

    def _hangup(self) -> None:
        if self._reload_config is None:
            log.warning("reload_unavailable", hint="this daemon was started without a configuration source to re-read")
            return
        # In a task: the check before a reload applies asks the engine.
        task = asyncio.get_running_loop().create_task(self._reload(self._reload_config))
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _reload(self, load: Callable[[], Config]) -> None:
        self._notifier.reloading()
        await self._daemon.reload(load)
        self._notifier.ready(self._daemon.describe())
