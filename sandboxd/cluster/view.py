"""The directory, as this process sees it: a local copy kept by a watch, read without a round trip.

``home``, ``node`` and ``nodes`` are dict lookups: a call's gate asks them, not etcd. The copy
starts from one range read and follows a watch from that read's revision; when the watch fails
(etcd restarted, a failover), a fresh read replaces the copy and a new watch follows it. A router
uses a view on its own; a host's ``Membership`` adds its lease and fencing.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from sandboxd.cluster.directory import Change, Directory, DirectoryUnavailable, Snapshot
from sandboxd.cluster.records import NodeRecord, UserRecord
from sandboxd.logging import get_logger

log = get_logger("sandboxd.cluster")

RESYNC_PAUSE_S = 0.5  # between a failed watch and the next read: a store down is not asked in a loop

# Told (user, record before, record now) when a user's record changes: a host learns a user left it.
UserChanged = Callable[[str, "UserRecord | None", "UserRecord | None"], None]


class DirectoryView:
    def __init__(self, directory: Directory, on_user: UserChanged | None = None) -> None:
        self.directory = directory
        self._on_user = on_user
        self._nodes: dict[str, NodeRecord] = {}
        self._users: dict[str, UserRecord] = {}
        self.revision = 0  # of the last change seen: a new watch starts after it
        self._read_at = 0  # revision of the last full read: no change up to it is applied again

    # -- lookups (synchronous) ----------------------------------------------------------------------

    def home(self, user: str) -> UserRecord | None:
        return self._users.get(user)

    def node(self, name: str) -> NodeRecord | None:
        return self._nodes.get(name)

    def nodes(self) -> dict[str, NodeRecord]:
        """Every registered node, by name (the view's own dict: read it, never change it)."""
        return self._nodes

    def users_of(self, node: str) -> list[str]:
        return [user for user, record in self._users.items() if record.node == node]

    # -- keeping it current ----------------------------------------------------------------------------

    async def sync(self) -> None:
        """Replace the copy with a fresh read of the whole directory."""
        self.load(await self.directory.snapshot())

    def load(self, snapshot: Snapshot) -> None:
        before = self._users
        self._nodes, self._users = dict(snapshot.nodes), dict(snapshot.users)
        self.revision = self._read_at = snapshot.revision
        if self._on_user is not None:
            for user in before.keys() | self._users.keys():
                old, new = before.get(user), self._users.get(user)
                if old != new:
                    self._on_user(user, old, new)

    def apply(self, change: Change) -> None:
        """One change from the watch; one this copy already holds (an older revision) is skipped."""
        if change.revision <= self._read_at:
            return
        self.revision = max(self.revision, change.revision)
        record = None if change.value is None else self.directory.parse(change.key, change.value, change.revision)
        kind, _, name = change.key[len(self.directory.prefix):].decode(errors="replace").partition("/")
        if kind == "nodes":
            self._put(self._nodes, name, record if isinstance(record, NodeRecord) else None)
        elif kind == "users":
            self.put_user(name, record if isinstance(record, UserRecord) else None)

    def put_user(self, user: str, record: UserRecord | None) -> None:
        """A user's record as a transaction of this process just wrote it (or the watch brought it)."""
        old = self._users.get(user)
        if record is not None and old is not None and record.epoch <= old.epoch:
            return  # the watch brought what the transaction's answer already put here
        self._put(self._users, user, record)
        if self._on_user is not None and old != record:
            self._on_user(user, old, record)

    @staticmethod
    def _put(table: dict, name: str, record: object) -> None:
        if record is None:
            table.pop(name, None)
        else:
            table[name] = record

    async def run(self) -> None:
        """Follow the watch for good; after a failure, read afresh and watch again."""
        while True:
            try:
                async for change in self.directory.changes(self.revision):
                    self.apply(change)
                log.warning("cluster_watch_ended", revision=self.revision)
            except DirectoryUnavailable as exc:
                log.warning("cluster_watch_failed", revision=self.revision, error=exc.message)
            except Exception as exc:  # aetcd's stream errors (etcd restarted, compacted): read afresh
                log.warning("cluster_watch_failed", revision=self.revision, error=repr(exc)[:300])
            await asyncio.sleep(RESYNC_PAUSE_S)
            try:
                await self.sync()
            except DirectoryUnavailable as exc:
                log.warning("cluster_resync_failed", error=exc.message)
