"""This host in the directory: ``nodes/<node>`` under a lease it keeps alive, and fencing.

A host serves its users only while its lease lives. It decides that by its own clock: a renewal
counts from when it was SENT (etcd extends the lease when it reads it, later), so the host fences
itself no later than etcd could expire the lease. A fenced host starts no calls until it has
registered again under a new lease and read the directory afresh (its users' records may have
changed while it could not see them).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from sandboxd.cluster.directory import Directory, DirectoryUnavailable
from sandboxd.cluster.records import NodeRecord
from sandboxd.cluster.view import DirectoryView
from sandboxd.errors import ConfigError
from sandboxd.logging import get_logger

log = get_logger("sandboxd.cluster")


class Fence:
    """Whether this host may start calls, by its own clock since its last renewal (a state machine, no I/O)."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lease_s = lease_s
        self._clock = clock
        self._renewed_at = clock()  # when the last renewal that etcd answered alive was sent
        self._fenced_at: float | None = None  # sticky: only ``cleared`` lifts it

    @property
    def fenced(self) -> bool:
        if self._fenced_at is not None:
            return True
        now = self._clock()
        if now - self._renewed_at >= self.lease_s:
            self._fence(now, "lease not renewed")
        return self._fenced_at is not None

    def renewed(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` was answered: the lease lives (a fenced host stays fenced)."""
        self._renewed_at = max(self._renewed_at, sent_at)

    def lost(self) -> None:
        """etcd answered that the lease is gone."""
        if self._fenced_at is None:
            self._fence(self._clock(), "lease expired in etcd")

    def cleared(self, registered_at: float) -> None:
        """Registered again under a new lease granted by a request sent at ``registered_at``, users re-read."""
        if self._fenced_at is not None:
            log.warning("cluster_unfenced", fenced_for_s=round(self._clock() - self._fenced_at, 2))
        self._fenced_at = None
        self._renewed_at = registered_at

    def _fence(self, now: float, why: str) -> None:
        self._fenced_at = now
        log.error("cluster_fenced", why=why, since_renewal_s=round(now - self._renewed_at, 2), lease_s=self.lease_s,
                  detail="no new calls start until this host has registered again")


class Membership:
    """Registers ``node`` under a lease, keeps it alive every lease_s/3, and re-registers after fencing."""

    def __init__(self, directory: Directory, view: DirectoryView, node: NodeRecord, lease_s: int) -> None:
        self.directory = directory
        self.view = view
        self.node = node
        self.lease_s = lease_s
        self.fence = Fence(lease_s)
        self.lease: int | None = None

    async def join(self, wait_s: float) -> None:
        """At start-up: register, waiting out a previous run's lease (up to ``wait_s``) for the node's name.

        ConfigError if another live host holds the name after that (two hosts configured with one name)."""
        deadline = time.monotonic() + wait_s
        while not await self._register():
            if time.monotonic() >= deadline:
                raise ConfigError(f"cluster.node {self.node.name!r} is registered by another running host (its "
                                  f"nodes/{self.node.name} key in etcd outlived {wait_s:g} s); give each host its own "
                                  "cluster.node, or stop the other one")
            await asyncio.sleep(0.5)

    async def _register(self) -> bool:
        """A new lease and the node's key under it, then a fresh read; False: the name is held by another lease."""
        sent_at = time.monotonic()
        drained = await self.directory.draining(self.node.name)  # an operator's drain outlives a restart
        self.node = NodeRecord(self.node.name, self.node.address, "draining" if drained else "active")
        lease = await self.directory.grant(self.lease_s)
        if not await self.directory.register(self.node, lease):
            await self.directory.revoke(lease)
            return False
        self.lease = lease
        await self.view.sync()  # the users' records as they are now, not as the old watch left them
        self.fence.cleared(sent_at)
        log.info("cluster_registered", node=self.node.name, address=self.node.address, lease=hex(lease))
        return True

    async def run(self) -> None:
        """Renew the lease every lease_s/3; once fenced, register again until that works."""
        interval = self.lease_s / 3
        failures = 0
        while True:
            sent_at = time.monotonic()
            try:
                if self.fence.fenced:
                    await self._rejoin()
                else:
                    await self._renew(sent_at)
                failures = 0
            except DirectoryUnavailable as exc:
                failures += 1
                log.warning("cluster_renewal_failed", node=self.node.name, error=exc.message, failures=failures)
                if failures % 3 == 0 and len(self.directory.urls) > 1:
                    await self._failover()
            await asyncio.sleep(max(0.0, sent_at + interval - time.monotonic()))

    async def _renew(self, sent_at: float) -> None:
        assert self.lease is not None
        if await self.directory.keepalive(self.lease) > 0:
            self.fence.renewed(sent_at)
        else:
            self.fence.lost()

    async def _rejoin(self) -> None:
        old, self.lease = self.lease, None
        if old is not None:  # its key, if etcd kept it, would block the new registration
            await self.directory.revoke(old)
        if not await self._register():
            log.warning("cluster_rejoin_waiting", node=self.node.name,
                        detail="the node's key is held by another lease; trying again")

    async def _failover(self) -> None:
        try:
            await self.directory.failover()
        except DirectoryUnavailable:
            pass  # the old connection's close timed out; the new one is in place anyway

    async def leave(self) -> None:
        """At shutdown: revoke the lease, so the node's key goes now, not lease_s later."""
        lease, self.lease = self.lease, None
        if lease is not None:
            try:
                await self.directory.revoke(lease)
            except DirectoryUnavailable as exc:
                log.warning("cluster_leave_failed", error=exc.message, detail="the node's key goes when its lease expires")

    def status(self) -> dict[str, object]:
        return {"node": self.node.name, "state": (self.view.node(self.node.name) or self.node).state, "address": self.node.address,
                "fenced": self.fence.fenced, "users": len(self.view.users_of(self.node.name))}
