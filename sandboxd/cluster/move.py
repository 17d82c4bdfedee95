"""A user's move from their host to another, as the operator's command runs it (docs/scale.md, "Moves and drains").

Four steps, each named in the error when it fails:

1. ``mark``: the record becomes ``moving`` (to the target); hosts refuse the user's new calls.
2. ``pull``: the target (``users/pull``) dials the source as ``node:TARGET``, which waits for the
   user's calls in flight to end (``wait_s``), snapshots the user and streams the export; the
   target imports it as it arrives, every file's sha256 checked.
3. ``check``: the source (``users/move_check``) says whether the email database changed after its
   snapshot (the mail sync wrote): then the copy is stale and the move stops.
4. ``flip``: one transaction names the target at a higher epoch, if the record is still the mark.

A failure after ``mark`` puts the record back to ``active`` on the source (served again), and the
target removes an import it holds. The source sets its copy aside once it sees the flip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from sandboxd.async_client import AsyncClient
from sandboxd.cluster.directory import Directory, Snapshot
from sandboxd.cluster.records import UserRecord
from sandboxd.errors import SandboxdError

Dial = Callable[[str, str], Awaitable[AsyncClient]]  # (address, node name) → a client of that host's listener


class MoveFailed(SandboxdError):
    """A move that did not happen; ``step`` is where it stopped, the message says why and where the user is."""

    def __init__(self, user: str, step: str, why: str, where: str) -> None:
        super().__init__(f"moving {user} failed at step {step}: {why} {where}", {"user": user, "step": step})
        self.step = step


@dataclass(frozen=True)
class Moved:
    user: str
    source: str
    target: str
    epoch: int
    files: int
    bytes: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"user": self.user, "from": self.source, "to": self.target, "epoch": self.epoch, "files": self.files,
                "bytes": self.bytes, "seconds": round(self.seconds, 3)}


def plan(snapshot: Snapshot, user: str, to: str) -> tuple[UserRecord, str, str]:
    """The user's record and the source's and target's addresses; MoveFailed (step ``plan``) when it cannot start."""
    def refuse(why: str) -> MoveFailed:
        return MoveFailed(user, "plan", why, "Nothing was changed.")

    record = snapshot.users.get(user)
    if record is None:
        raise refuse(f"{user} has no home host yet (their first call places them); there is nothing to move.")
    if record.state == "moving":
        raise refuse(f"{user} is being moved to {record.to} already; wait for that move, or end one whose "
                     f"operator died with `sandboxd users move {user} --abort`.")
    if record.node == to:
        raise refuse(f"{user} lives on {to} already.")
    source, target = snapshot.nodes.get(record.node), snapshot.nodes.get(to)
    if source is None or source.address is None:
        raise refuse(f"{user}'s host {record.node} is down or has no cluster.listen (sandboxd nodes list); "
                     "a move needs it up to read the user.")
    if target is None or target.address is None:
        raise refuse(f"host {to} is not registered, or has no cluster.listen (sandboxd nodes list shows the hosts).")
    if target.state != "active":
        raise refuse(f"host {to} is {target.state}: it takes no users. Pick an active host, or "
                     f"`sandboxd nodes undrain {to}`.")
    return record, source.address, target.address


async def move(directory: Directory, dial: Dial, user: str, to: str, *, wait_s: float) -> Moved:
    """Move ``user`` to host ``to``; MoveFailed says at which step and why (the user then stays where they were)."""
    started = time.monotonic()
    record, source_address, target_address = plan(await directory.snapshot(), user, to)
    moving = await directory.mark_moving(record, to)
    if moving is None:
        raise MoveFailed(user, "mark", "the record changed between the read and the mark (another move, or an "
                                       "operator); run the command again.", "Nothing was changed.")
    step, pulled = "pull", None
    try:
        pulled = await _call(dial, target_address, to, "users/pull", {
            "user": user, "from": record.node, "address": source_address, "epoch": moving.epoch,
            "waitMs": int(wait_s * 1000)})
        step = "check"
        await _call(dial, source_address, record.node, "users/move_check", {"user": user, "epoch": moving.epoch})
        step = "flip"
        flipped = await directory.flip(moving)
        if flipped is None:
            raise SandboxdError("the record changed after the mark (an operator's --abort?); the move is undone.")
    except Exception as exc:  # every failure: undone below, and told with its step
        where = await _undo(directory, dial, moving, target_address, pulled is not None)
        raise MoveFailed(user, step, _why(exc), where) from exc
    return Moved(user, record.node, to, flipped.epoch, int(pulled.get("files", 0)), int(pulled.get("bytes", 0)),
                 time.monotonic() - started)


async def abort(directory: Directory, user: str) -> UserRecord:
    """End a move whose operator died: the record back to ``active`` on its source (a target's import stays
    until `users/discard`: it is not served, the directory names the source)."""
    record = await directory.user(user)
    if record is None or record.state != "moving":
        raise MoveFailed(user, "abort", "the user is not being moved.", "Nothing was changed.")
    back = await directory.abort(record)
    if back is None:
        raise MoveFailed(user, "abort", "the record changed meanwhile (the move ended?).", "Run the command again.")
    return back


async def rehome(directory: Directory, user: str, to: str) -> tuple[UserRecord, UserRecord]:
    """Point a user whose home host is down at host ``to``, without their data there (a move needs the source
    up): (the record before, the record now). Refused while that host holds its lease: then it may serve."""
    snapshot = await directory.snapshot()
    record = snapshot.users.get(user)
    if record is None:
        raise MoveFailed(user, "rehome", "the user has no home yet.", "The first host asked claims them; nothing "
                         "was changed.")
    if record.node in snapshot.nodes:
        raise MoveFailed(user, "rehome", f"their host {record.node} is up (its lease is alive).",
                         f"Nothing was changed: move them with `sandboxd users move {user} --to {to}`.")
    target = snapshot.nodes.get(to)
    if target is None or target.state != "active":
        state = "not registered" if target is None else target.state
        raise MoveFailed(user, "rehome", f"host {to} is {state}.", "Nothing was changed: pick an active host "
                         "(sandboxd nodes list).")
    new = await directory.rehome(record, to)
    if new is None:
        raise MoveFailed(user, "rehome", f"the record changed meanwhile, or {record.node} registered again.",
                         "Nothing was changed: run the command again.")
    return record, new


async def _call(dial: Dial, address: str, node: str, method: str, params: dict[str, Any]) -> Any:
    client = await dial(address, node)
    try:
        return await client.call(method, params)
    finally:
        await client.close()


async def _undo(directory: Directory, dial: Dial, moving: UserRecord, target_address: str, imported: bool) -> str:
    """Put the user back on the source, then have the target drop its import; where the user is, said for people."""
    try:
        back = await directory.abort(moving)
    except SandboxdError as exc:
        return (f"The user is still marked moving (the directory did not answer: {exc.message}); run "
                f"`sandboxd users move {moving.user} --abort` once etcd answers.")
    if back is None:
        return "The user's record changed meanwhile: `sandboxd users where` shows where they are."
    if imported:
        try:
            await _call(dial, target_address, str(moving.to), "users/discard", {"user": moving.user})
        except Exception as exc:  # noqa: BLE001 - told: the copy is not served, only its space is lost
            return (f"{moving.user} is active on {moving.node} again; the copy on {moving.to} could not be removed "
                    f"({_why(exc)}); it is not served: remove its folders there by hand (DATA_PATH/USER and its email folder).")
    return f"{moving.user} is active on {moving.node} again, served as before."


def _why(exc: BaseException) -> str:
    return str(getattr(exc, "message", None) or exc) or type(exc).__name__
