"""The directory's records and the per-call gate, without I/O (docs/scale.md, "Several hosts").

Keys under ``cluster.prefix``: ``nodes/<node>`` holds a ``NodeRecord`` under that host's lease
(gone when the lease expires), ``users/<user>`` a ``UserRecord`` under no lease. A user's epoch
is their key's mod_revision in etcd: it only rises, and a move's transaction compares it.
``decide`` is the gate: what a host does with a call, from its local view alone.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from sandboxd.cluster.rendezvous import place
from sandboxd.errors import NotServedHere

NodeState = Literal["active", "draining"]
UserState = Literal["active", "moving"]
# What a client waits before it asks again about a user being moved (a move takes seconds).
MOVING_RETRY_MS = 1000


class BadRecord(ValueError):
    """A value under the prefix that is not a record this version writes."""


@dataclass(frozen=True)
class NodeRecord:
    name: str
    address: str | None  # what other hosts and routers dial (cluster.dial_address()); None: no listener
    state: NodeState = "active"

    def dump(self) -> bytes:
        return json.dumps({"address": self.address, "state": self.state}, sort_keys=True).encode()

    @classmethod
    def load(cls, name: str, value: bytes) -> NodeRecord:
        data = _object(value)
        address, state = data.get("address"), data.get("state", "active")
        if address is not None and not isinstance(address, str) or state not in ("active", "draining"):
            raise BadRecord(f"nodes/{name}: {value[:200]!r} is not a node record")
        return cls(name, address, state)


@dataclass(frozen=True)
class UserRecord:
    user: str
    node: str  # the user's home host
    epoch: int  # the key's mod_revision: 0 for a record not yet written
    state: UserState = "active"
    to: str | None = None  # while moving: the host the user moves to
    left: str | None = None  # rehomed off this dead host (`users rehome`): its copy is stale when it is back

    def dump(self) -> bytes:
        data: dict[str, Any] = {"node": self.node, "state": self.state}
        if self.to is not None:
            data["to"] = self.to
        if self.left is not None:
            data["left"] = self.left
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def load(cls, user: str, value: bytes, epoch: int) -> UserRecord:
        data = _object(value)
        node, state, to, left = data.get("node"), data.get("state", "active"), data.get("to"), data.get("left")
        if (not isinstance(node, str) or state not in ("active", "moving") or not (to is None or isinstance(to, str))
                or not (left is None or isinstance(left, str))):
            raise BadRecord(f"users/{user}: {value[:200]!r} is not a user record")
        return cls(user, node, epoch, state, to, left)

    def to_json(self) -> dict[str, Any]:
        return {"user": self.user, "node": self.node, "epoch": self.epoch, "state": self.state, "to": self.to,
                **({"left": self.left} if self.left is not None else {})}


def _object(value: bytes) -> dict[str, Any]:
    try:
        data = json.loads(value)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise BadRecord(f"{value[:200]!r} is not a JSON object")
    return data


def _placed_elsewhere(user: str, nodes: Mapping[str, NodeRecord], me: str) -> NotServedHere | None:
    """A draining host claims no new user: ``elsewhere``, at the active host rendezvous hashing picks (None: none is)."""
    mine = nodes.get(me)
    if mine is None or mine.state != "draining":
        return None
    node = place(user, [name for name, record in nodes.items() if record.state == "active"])
    if node is None:
        return None  # no host takes new users: this one serves them rather than no one
    address = nodes[node].address
    return NotServedHere("elsewhere", f"this host ({me}) is draining and takes no new users; {user} goes to host "
                                      f"{node}{f' at {address}' if address else ''}: send the call there.",
                         node=node, address=address)


# -- the gate ----------------------------------------------------------------------------------------

CLAIM = "claim"  # the user has no record: this host claims them (create-if-absent) before it serves


def decide(user: str, record: UserRecord | None, nodes: Mapping[str, NodeRecord], me: str,
           fenced: bool) -> int | str | NotServedHere:
    """What this host does with a call of ``user``: serve it (the record's epoch), ``CLAIM`` the
    user first, or refuse it (the error to answer). A fenced host's view may be stale: it refuses first."""
    if fenced:
        return NotServedHere("fenced", f"this host ({me}) lost its lease in the cluster's directory and starts no "
                                       "calls until it has registered again; retry in a few seconds or on another host.")
    if record is None:
        return _placed_elsewhere(user, nodes, me) or CLAIM
    if record.state == "moving":
        return NotServedHere("moving", f"{user} is being moved to another host; retry in {MOVING_RETRY_MS} ms.",
                             retry_after_ms=MOVING_RETRY_MS)
    if record.node == me:
        return record.epoch
    home = nodes.get(record.node)
    if home is None:
        return NotServedHere("node_down", f"{user}'s home host {record.node} is down (its lease in the directory "
                                          "expired); retry once it is back, or have an operator move the user.",
                             node=record.node)
    return NotServedHere("elsewhere", f"{user} is served by host {record.node}"
                                      f"{f' at {home.address}' if home.address else ''}; send the call there.",
                         node=record.node, address=home.address)
