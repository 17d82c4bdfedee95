"""Draining a host (``sandboxd nodes drain``): no new users placed on it, then its users moved one by one.

Each user goes where rendezvous hashing over the active hosts puts them (cluster/rendezvous.py),
the place a router or a draining host sends a new user, so a drained host's users spread as
new ones would. One user at a time: a move holds only that user's calls, and a failure stops
no other user's move (it is told, and the user stays on the draining host, served).
"""

from __future__ import annotations

from typing import Any, Callable

from sandboxd.cluster.directory import Directory
from sandboxd.cluster.move import Dial, MoveFailed, move
from sandboxd.cluster.rendezvous import place
from sandboxd.errors import SandboxdError

Told = Callable[[dict[str, Any]], None]  # one line of progress: a user moved, or not


class DrainRefused(SandboxdError):
    """The drain cannot start (the host is not registered, or no other host is active)."""


async def drain(directory: Directory, dial: Dial, node: str, *, wait_s: float, told: Told) -> list[str]:
    """Mark ``node`` draining and move its users off it; the users that could not be moved (each told)."""
    snapshot = await directory.snapshot()
    if node not in snapshot.nodes:
        raise DrainRefused(f"host {node} is not registered (down, or another name: sandboxd nodes list); a drain "
                           "moves users off a running host.")
    await directory.set_draining(node, True)
    failed: list[str] = []
    while True:
        snapshot = await directory.snapshot()
        left = sorted(user for user, record in snapshot.users.items() if record.node == node and user not in failed)
        if not left:
            return failed
        user = left[0]
        to = place(user, [name for name, record in snapshot.nodes.items() if record.state == "active" and name != node])
        if to is None:
            raise DrainRefused(f"no other host is active to take {node}'s {len(left)} users; start one, or undrain "
                               "one (sandboxd nodes undrain), and drain again.")
        try:
            moved = await move(directory, dial, user, to, wait_s=wait_s)
        except MoveFailed as exc:
            failed.append(user)
            told({"user": user, "from": node, "to": to, "ok": False, "step": exc.step, "error": exc.message})
            continue
        told({**moved.to_json(), "ok": True, "left": len(left) - 1})


async def undrain(directory: Directory, node: str) -> bool:
    """``node`` active again (new users may be placed on it); False when it is not registered now."""
    return await directory.set_draining(node, False) is not None
