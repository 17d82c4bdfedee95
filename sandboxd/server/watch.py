"""tools/watch: tell a connection when the tools a user sees change.

Discovery is live (each listing looks at the disk again), so a client that keeps a
catalogue, such as `sandboxd mcp` for an MCP host, must learn when to list again. After
`tools/watch {"user": U}` the connection gets `notifications/tools/list_changed
{"user": U}` within about ``WATCH_INTERVAL_S`` of a tool being added, removed or edited
in the global tools or in U's own. The check compares each watched root's fingerprint
(stat calls in a worker thread, nothing parsed), so watching costs a few stat calls per
tool a second, and nothing while nobody watches.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Callable

from sandboxd.errors import InvalidParams
from sandboxd.tools.discovery import ToolCatalog
from sandboxd.users import check_user
from sandboxd.wire import TOOLS_LIST_CHANGED, Message, notification

WATCH_INTERVAL_S = 1.0
MAX_WATCHES_PER_CONNECTION = 16  # users one connection may watch; a client serves one user or a few

Send = Callable[[Message], None]


class ToolWatch:
    def __init__(self, catalog: ToolCatalog) -> None:
        self._catalog = catalog
        self._watchers: dict[object, tuple[Send, set[str | None]]] = {}  # by connection
        self._fingerprints: dict[Path, Any] = {}  # of every root someone watches, as last seen

    async def watch(self, key: object, send: Send, params: Any) -> dict[str, Any]:
        """Register ``params["user"]`` for the connection ``key``; answered once its roots have a baseline."""
        if params is not None and not isinstance(params, dict):
            raise InvalidParams("tools/watch params must be an object like {\"user\": \"alice@example.com\"}.")
        user = params.get("user") if params else None
        user = None if user is None else check_user(user)
        users = self._watchers.setdefault(key, (send, set()))[1]
        if user not in users and len(users) >= MAX_WATCHES_PER_CONNECTION:
            raise InvalidParams(f"a connection may watch at most {MAX_WATCHES_PER_CONNECTION} users; "
                                "open another connection for more.")
        users.add(user)  # before the wait below: a connection that closes meanwhile is forgotten for good
        # The baseline is taken before the answer, so any change after it is told.
        new = [root for root in self._catalog.roots(user) if root[0] not in self._fingerprints]
        if new:
            for root, fingerprint in (await asyncio.to_thread(self._take, new)).items():
                self._fingerprints.setdefault(root, fingerprint)  # a check may have taken it meanwhile
        return {}

    def forget(self, key: object) -> None:
        """The connection closed."""
        self._watchers.pop(key, None)

    async def run(self) -> None:
        """Check the watched roots every WATCH_INTERVAL_S until cancelled."""
        while True:
            await asyncio.sleep(WATCH_INTERVAL_S)
            await self.check()

    async def check(self) -> None:
        watched = {root for _, users in self._watchers.values() for user in users
                   for root in self._catalog.roots(user)}
        for root in set(self._fingerprints) - {root for root, _ in watched}:
            del self._fingerprints[root]  # nobody watches it any more
        if not watched:
            return
        current = await asyncio.to_thread(self._take, sorted(watched))
        changed = set()
        for root, fingerprint in current.items():
            if root in self._fingerprints and self._fingerprints[root] != fingerprint:
                changed.add(root)
            self._fingerprints[root] = fingerprint
        if not changed:
            return
        for send, users in list(self._watchers.values()):
            for user in users:
                if any(root in changed for root, _ in self._catalog.roots(user)):
                    send(notification(TOOLS_LIST_CHANGED, {} if user is None else {"user": user}))

    def _take(self, roots: list[tuple[Path, Any]]) -> dict[Path, Any]:
        return {root: self._catalog.fingerprint(root, source) for root, source in roots}
