"""Which host serves a user: the directory's answer, read from the router's local view (no etcd round trip).

``decide`` is pure: the view in, one ``Decision`` out. A user with a home goes there, a user being
moved waits, a user whose home's lease is gone is refused ``node_down`` at once, and a user with no
home is placed by rendezvous hashing over the active hosts (a draining host gets no one), then
claimed (the claim's winner is used, whoever it is).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, NamedTuple, Protocol

from sandboxd.cluster.records import MOVING_RETRY_MS, NodeRecord, UserRecord
from sandboxd.errors import BackendUnavailable, NotServedHere, SandboxdError
from sandboxd.cluster.rendezvous import place

REFUSED = NotServedHere.code  # a host refused the call before starting it; data.reason says why


class Directory(Protocol):
    """The router's view of the directory, kept by a watch: lookups are synchronous and local."""

    def home(self, user: str) -> UserRecord | None: ...

    def node(self, name: str) -> NodeRecord | None:
        """The host registered as ``name`` (its lease alive), or None."""

    def nodes(self) -> Mapping[str, NodeRecord]: ...

    async def claim(self, user: str, node: str) -> UserRecord:
        """Give ``user`` the home ``node`` unless they have one already; the record they have afterwards."""

    async def changed(self, timeout_s: float) -> None:
        """Return at the view's next change of a user, or after ``timeout_s``."""


class Decision(NamedTuple):
    action: Literal["forward", "place", "wait", "refuse"]
    node: str | None = None
    address: str | None = None
    refusal: SandboxdError | None = None


def node_down(user: str, node: str) -> NotServedHere:
    return NotServedHere("node_down", f"{user}'s home host {node} is down (its lease in the directory expired); "
                                      "retry once it is back, or have an operator move the user.", node=node)


def moving(user: str, node: str) -> NotServedHere:
    return NotServedHere("moving", f"{user} is being moved from host {node} and the call's deadline passed while the "
                                   f"router waited; retry in {MOVING_RETRY_MS} ms.", node=node,
                         retry_after_ms=MOVING_RETRY_MS)


def no_host() -> BackendUnavailable:
    return BackendUnavailable("no host is active in the cluster's directory; start a host or undrain one "
                              "(sandboxd nodes list shows them).")


def unlistening(node: str) -> BackendUnavailable:
    return BackendUnavailable(f"host {node} has no cluster listener, so the router cannot reach it; set "
                              "cluster.listen and cluster.advertise in its config and restart it.")


def decide(user: str, view: Directory) -> Decision:
    home = view.home(user)
    if home is None:
        node = place(user, [name for name, host in view.nodes().items() if host.state == "active"])
        return Decision("refuse", refusal=no_host()) if node is None else Decision("place", node)
    if home.state == "moving":
        return Decision("wait", home.node)
    host = view.node(home.node)
    if host is None:
        return Decision("refuse", home.node, refusal=node_down(user, home.node))
    if host.address is None:
        return Decision("refuse", home.node, refusal=unlistening(home.node))
    return Decision("forward", home.node, host.address)


def refusal_of(answer: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(reason, data) of a host's -32005 answer, the one answer a call may be sent again after; else None."""
    error = answer.get("error")
    if not isinstance(error, dict) or error.get("code") != REFUSED:
        return None
    data = error.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("reason"), str):
        return None
    return data["reason"], data
