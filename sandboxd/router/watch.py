"""tools/watch through the router: clients' watches kept here, one watch per user sent to the user's host.

A host lets one connection watch ``MAX_WATCHES_PER_CONNECTION`` users, and the router's
connections to it are shared by every client, so the router holds the clients' watches
(the same bound per client connection) and asks each host once per user. A host's
``notifications/tools/list_changed`` goes to every client that watches that user. When
the connection carrying a host's watch closes, the watchers are told to list again (a
change may have gone unheard) and the router sends the watch again.
"""

from __future__ import annotations

from typing import Any, Callable

from sandboxd.errors import InvalidParams
from sandboxd.server.watch import MAX_WATCHES_PER_CONNECTION
from sandboxd.users import check_user
from sandboxd.wire import TOOLS_LIST_CHANGED, Message, notification

Send = Callable[[Message], None]


def watched_user(params: Any) -> str | None:
    if params is not None and not isinstance(params, dict):
        raise InvalidParams("tools/watch params must be an object like {\"user\": \"alice@example.com\"}.")
    user = params.get("user") if params else None
    return None if user is None else check_user(user)


class Watches:
    def __init__(self) -> None:
        self.clients: dict[object, tuple[Send, set[str | None]]] = {}  # by client connection
        self.at_hosts: dict[str | None, tuple[str, object]] = {}  # user → (node, upstream connection) watching

    def add(self, client: object, send: Send, user: str | None) -> bool:
        """Register ``user`` for ``client``; True when no host watches the user for the router yet."""
        users = self.clients.setdefault(client, (send, set()))[1]
        if user not in users and len(users) >= MAX_WATCHES_PER_CONNECTION:
            raise InvalidParams(f"a connection may watch at most {MAX_WATCHES_PER_CONNECTION} users; "
                                "open another connection for more.")
        users.add(user)
        return user not in self.at_hosts

    def held(self, user: str | None, node: str, connection: object) -> None:
        """The host ``node`` watches ``user`` on ``connection`` (its answer came)."""
        self.at_hosts[user] = (node, connection)

    def forget(self, client: object) -> None:
        self.clients.pop(client, None)

    def changed(self, node: str, params: Any) -> None:
        """A host's list_changed: to every client watching its user."""
        user = params.get("user") if isinstance(params, dict) else None
        if self.at_hosts.get(user, (None,))[0] != node:
            return  # a host that no longer holds the router's watch of this user (it moved)
        self._tell(user)

    def lost(self, connection: object) -> list[str | None]:
        """An upstream connection closed: its watches are gone, their watchers told to list again; the users
        still watched by a client, whose watch is to be sent again."""
        gone = [user for user, (_, conn) in self.at_hosts.items() if conn is connection]
        for user in gone:
            del self.at_hosts[user]
            self._tell(user)
        return [user for user in gone if any(user in users for _, users in self.clients.values())]

    def _tell(self, user: str | None) -> None:
        message = notification(TOOLS_LIST_CHANGED, {} if user is None else {"user": user})
        for send, users in list(self.clients.values()):
            if user in users:
                send(message)
