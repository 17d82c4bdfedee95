"""The router's view of the directory in memory (``routing.Directory``), for the router's unit tests."""

from __future__ import annotations

import asyncio

from sandboxd.cluster.records import NodeRecord, UserRecord


class View:
    """Hosts (name → state, at ``NAME.test:7443``) and homes as the test sets them; a claim gives the first host
    asked; ``put`` changes a home and wakes the calls waiting on a change."""

    def __init__(self, hosts: dict[str, str] | None = None, users: dict[str, UserRecord] | None = None) -> None:
        self.hosts = {name: NodeRecord(name, f"{name}.test:7443", state) for name, state in (hosts or {}).items()}
        self.users = dict(users or {})
        self._changed = asyncio.Event()

    def home(self, user: str) -> UserRecord | None:
        return self.users.get(user)

    def node(self, name: str) -> NodeRecord | None:
        return self.hosts.get(name)

    def nodes(self) -> dict[str, NodeRecord]:
        return self.hosts

    async def claim(self, user: str, node: str) -> UserRecord:
        self.users.setdefault(user, UserRecord(user, node, 1))
        return self.users[user]

    async def changed(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def put(self, user: str, record: UserRecord) -> None:
        self.users[user] = record
        self._changed.set()
        self._changed = asyncio.Event()
