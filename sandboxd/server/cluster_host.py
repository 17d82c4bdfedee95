"""The daemon as one host of several (``cluster:``; docs/scale.md): registered in etcd's directory at
start-up, the gate of every call, deregistered at shutdown.

The gate reads the local view only (cluster/view.py): a call costs no etcd round trip unless its
user has no record yet, when this host claims them. The calls served are logged as ``call_served``
lines, one per user and epoch each second: the first start and last end (wall clock) of the calls
that ended meanwhile, and how many. They are the record that no user ran on two hosts at once, at a
dict update per call instead of a log line.
Without ``cluster:`` none of this exists and aetcd is never imported.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any, Protocol

from sandboxd.cluster.records import NodeRecord, UserRecord, decide
from sandboxd.config import Config
from sandboxd.errors import BackendUnavailable, ConfigError, NotServedHere
from sandboxd.logging import get_logger
from sandboxd.server.moves import Moves

if TYPE_CHECKING:
    from sandboxd.cluster.membership import Membership
    from sandboxd.cluster.view import DirectoryView
    from sandboxd.sandbox.pool import Pool
    from sandboxd.server.calls import Calls

log = get_logger("sandboxd.cluster")

STARTUP_WAIT_S = 10.0  # for etcd to answer at start-up, before the daemon gives up with the endpoints named
SERVED_EVERY_S = 1.0  # how often the calls served are logged, one line per user and epoch
LEFT_KILL = ("sandboxd: this user now lives on another host (moved there), so the call was stopped; "
             "call again: the answer names the host.")


class Daemon(Protocol):
    """What the host needs of the server: its calls in flight and its pool, to stop a user who left."""

    calls: Calls
    pool: Pool
    config: Config


class ClusterHost:
    def __init__(self, config: Config, daemon: Daemon) -> None:
        # Imported here: a daemon without cluster: never loads aetcd (nor its gRPC); records.py imports neither.
        from sandboxd.cluster.directory import Directory
        from sandboxd.cluster.membership import Membership
        from sandboxd.cluster.view import DirectoryView

        cluster = config.cluster
        assert cluster is not None and cluster.node is not None
        self.me = cluster.node
        self._daemon = daemon
        self.directory = Directory(cluster)
        self.view: DirectoryView = DirectoryView(self.directory, on_user=self._user_changed)
        self.membership: Membership = Membership(self.directory, self.view,
                                                 NodeRecord(cluster.node, cluster.dial_address()), cluster.lease_s)
        self._tasks: list[asyncio.Task[None]] = []
        self._served: dict[tuple[str, int], list[float]] = {}  # (user, epoch) → [first start, last end, calls]
        self.keep_moved_s = cluster.keep_moved_s
        # A move's two ends (users/handover, users/pull ...): server/moves.py.
        self.moves = Moves(self.me, self.view, self.directory, lambda: daemon.config,
                           lambda: daemon.calls.holds)

    @classmethod
    def of(cls, config: Config, daemon: Daemon) -> ClusterHost | None:
        """The host of ``config``'s cluster: section; None for a standalone daemon."""
        if config.cluster is None:
            return None
        if config.cluster.node is None:
            raise ConfigError("cluster.node is required on a host: this host's name in the directory, e.g. 'node1'")
        return cls(config, daemon)

    async def start(self) -> None:
        """Register (waiting up to STARTUP_WAIT_S for etcd), then follow the directory and renew the lease."""
        from sandboxd.cluster.directory import DirectoryUnavailable

        deadline = time.monotonic() + STARTUP_WAIT_S
        while True:
            try:
                await self.membership.join(self.membership.lease_s + 1.0)
                break
            except DirectoryUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise ConfigError(f"{exc.message} The daemon needs the directory to start: start etcd, or fix "
                                      "cluster.etcd, or remove the cluster: section to run this host alone.") from exc
            await asyncio.sleep(0.5)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.view.run()), loop.create_task(self.membership.run()),
                       loop.create_task(self._log_served_every(SERVED_EVERY_S)),
                       loop.create_task(self.moves.sweep(self.keep_moved_s))]

    async def stop(self) -> None:
        """Stop following the directory and revoke the lease: the node's key goes now, not lease_s later."""
        for task in self._tasks:
            task.cancel()
        self._log_served()
        await self.membership.leave()
        try:
            await self.directory.close()
        except Exception:  # noqa: BLE001 - closing a channel etcd no longer answers on: nothing to keep
            pass

    # -- the gate ---------------------------------------------------------------------------------------

    def admit(self, user: str) -> int | None:
        """The epoch a call of ``user`` runs at; None: claim the user first; NotServedHere: refused."""
        verdict = decide(user, self.view.home(user), self.view.nodes(), self.me, self.membership.fence.fenced)
        if isinstance(verdict, NotServedHere):
            raise verdict
        return verdict if isinstance(verdict, int) else None  # else CLAIM

    async def claim(self, user: str) -> int:
        """Claim ``user`` for this host (create-if-absent); the winner's record decides the call."""
        from sandboxd.cluster.directory import DirectoryUnavailable

        try:
            record = await self.directory.claim(user, self.me)
        except DirectoryUnavailable as exc:
            raise BackendUnavailable(f"{user} has no home host yet and this host could not claim them: "
                                     f"{exc.message} Retry in a few seconds.") from exc
        self.view.put_user(user, record)
        epoch = self.admit(user)
        assert epoch is not None, "the claim left the user without a record"
        return epoch

    def serves(self, user: str) -> bool:
        """Whether a call of ``user`` would be served here now, a new user's claim included (tools/list warms
        their sandbox only then)."""
        try:
            self.admit(user)
        except NotServedHere:
            return False
        return True

    def served(self, user: str, epoch: int, start: float) -> None:
        """The per-host call log: a call of ``user`` at ``epoch`` ran here from ``start`` until now (wall clock)."""
        end = time.time()
        span = self._served.get((user, epoch))
        if span is None:
            self._served[(user, epoch)] = [start, end, 1]
        else:
            span[0], span[1], span[2] = min(span[0], start), max(span[1], end), span[2] + 1

    def _log_served(self) -> None:
        served, self._served = self._served, {}
        for (user, epoch), (start, end, calls) in served.items():
            log.info("call_served", user=user, epoch=epoch, start=start, end=end, calls=int(calls), node=self.me)

    async def _log_served_every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            self._log_served()

    def _user_changed(self, user: str, old: UserRecord | None, new: UserRecord | None) -> None:
        """A user who lived here lives elsewhere now (moved): their calls stop and their sandboxes go."""
        self.moves.user_changed(user, old, new)
        if old is None or old.node != self.me or (new is not None and new.node == self.me):
            return
        killed = sum(ctx.kill(LEFT_KILL) for ctx in list(self._daemon.calls.in_flight)
                     if ctx.sandbox is not None and ctx.sandbox.user == user)
        retired = self._daemon.pool.retire(user)
        log.warning("cluster_user_left", user=user, to=None if new is None else new.node, calls_ended=killed,
                    sandboxes=len(retired))

    def status(self) -> dict[str, Any]:
        return self.membership.status()
