"""A move's two ends on the hosts (cluster/move.py runs the steps; docs/scale.md, "Moves and drains").

On the source: ``users/handover`` (a node's, raw: server/raw.py) waits until this host's view
shows the user ``moving``, holds the user's calls until those in flight end, snapshots them
and streams the export; the snapshot is kept so ``users/move_check`` can tell whether the email
database changed since. Once the user's record names another host, their copy is set aside
(storage/moved.py) and removed ``cluster.keep_moved_s`` later.

On the target: ``users/pull`` dials the source as this node and imports the stream as it
arrives (no copy of the archive in between); ``users/discard`` removes an import the move
could not flip to. Both are the operator's (cluster/roles.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

from sandboxd.cluster.records import UserRecord
from sandboxd.config import Config
from sandboxd.errors import InvalidParams, PeerRefused
from sandboxd.logging import get_logger
from sandboxd.server.calls.holds import CallsStillRunning, UserHolds
from sandboxd.server.pull import pull_user
from sandboxd.server.raw import Raw, RawChannel
from sandboxd.server.rpc import Later, Method
from sandboxd.server.transfer import Peer, UserTransfer
from sandboxd.storage import moved
from sandboxd.storage.provision import sandbox_uid
from sandboxd.storage.transfer.export import Snapshot, stream, take_snapshot
from sandboxd.users import check_user

if TYPE_CHECKING:
    from sandboxd.cluster.view import DirectoryView
    from sandboxd.cluster.directory import Directory

log = get_logger("sandboxd.cluster")

SEEN_WAIT_S = 5.0  # for this host's view to show the mark the operator wrote (the watch's delay)
MAX_WAIT_S = 3600.0
KEEP_SNAPSHOT_S = 3600.0  # a snapshot whose move never ended (its operator died) is dropped after this


@dataclass
class _Handed:
    epoch: int
    snapshot: Snapshot
    at: float


class Moves:
    def __init__(self, me: str, view: DirectoryView, directory: Directory, config: Callable[[], Config],
                 holds: Callable[[], UserHolds]) -> None:
        self.me, self._view, self._directory, self._config, self._holds = me, view, directory, config, holds
        self._handed: dict[str, _Handed] = {}  # user → the snapshot of their move out of here

    def methods(self, peer: Peer) -> Mapping[str, Method]:
        def operator(method: str, work: Callable[[Any], Any]) -> Method:
            def run(_id: Any, params: Any) -> Any:
                _allowed(peer, method)
                return work(_object(method, params))
            return run

        return {"users/handover": operator("users/handover", lambda params: Raw(
                    lambda channel: self._handover(channel, params))),
                "users/move_check": operator("users/move_check", self._move_check),
                "users/pull": operator("users/pull", lambda params: Later(self._pull(params))),
                "users/discard": operator("users/discard", lambda params: Later(self._discard(params)))}

    # -- the source ------------------------------------------------------------------------------

    async def _handover(self, channel: RawChannel, params: dict[str, Any]) -> None:
        user, epoch = check_user(params.get("user")), _epoch(params)
        wait_s = min(MAX_WAIT_S, max(0.0, float(params.get("waitMs") or 0) / 1000))
        await self._seen(user, epoch)
        config = self._config()
        self._drop(user)  # a snapshot of an earlier try
        try:
            async with self._holds().hold(user, wait_s=wait_s):
                snap = await asyncio.to_thread(take_snapshot, config, user, sandbox_uid=sandbox_uid(config),
                                               freeze=os.geteuid() == 0)
                self._handed[user] = _Handed(epoch, snap, time.monotonic())
                log.info("move_snapshot", user=user, epoch=epoch, frozen=snap.frozen,
                         bytes=snap.manifest.total_bytes)
                channel.answer({"user": user, "epoch": epoch, "bytes": snap.manifest.total_bytes})
                chunks = stream(snap)
                while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                    await channel.write(chunk)
        except CallsStillRunning as exc:
            raise InvalidParams(f"{exc} (the move's --wait); move again when they are done, or with a longer "
                                "--wait.") from None

    async def _seen(self, user: str, epoch: int) -> None:
        """Return once this host's view shows ``user`` moving at ``epoch``: from then on it refuses their calls."""
        deadline = time.monotonic() + SEEN_WAIT_S
        while not _is_mark(self._view.home(user), self.me, epoch):
            if time.monotonic() >= deadline:
                raise InvalidParams(f"{user} is not marked moving from this host ({self.me}) at epoch {epoch} in "
                                    f"its view of the directory; the move's mark changed (run the move again).")
            await asyncio.sleep(0.02)

    def _move_check(self, params: dict[str, Any]) -> dict[str, Any]:
        user, epoch = check_user(params.get("user")), _epoch(params)
        handed = self._handed.get(user)
        if handed is None or handed.epoch != epoch:
            raise InvalidParams(f"this host has no snapshot of {user}'s move at epoch {epoch}; run the move again.")
        if handed.snapshot.email_changed():
            raise InvalidParams(f"{user}'s email database changed after the move's snapshot (its writer, the mail "
                                "sync, committed), so the copy on the target is stale. Stop the mail sync for the "
                                "user, move again, and start it against the new host (docs/scale.md).")
        return {"user": user, "epoch": epoch, "emailChanged": False}

    def user_changed(self, user: str, old: UserRecord | None, new: UserRecord | None) -> None:
        """A record changed: a move out of here ended (its snapshot goes) and, flipped, the user's copy is set aside;
        so is the stale copy of a user rehomed off this host while it was down."""
        handed = self._handed.get(user)
        if handed is not None and not _is_mark(new, self.me, handed.epoch):
            self._drop(user)
        if old is not None and old.node == self.me and new is not None and new.node != self.me:
            asyncio.get_running_loop().create_task(self._set_aside(user, new.node))
        elif old is None and new is not None and new.left == self.me:
            # First seen (at start-up) rehomed off this host while it was down (`users rehome`): a copy is stale.
            asyncio.get_running_loop().create_task(self._set_aside(user, new.node))

    async def _set_aside(self, user: str, node: str) -> None:
        try:
            paths = await asyncio.to_thread(moved.set_aside, self._config(), user)
        except OSError as exc:
            log.error("moved_set_aside_failed", user=user, error=str(exc))
            return
        if paths:  # a rehomed user's host may hold no copy (it lost its disk)
            log.info("moved_set_aside", user=user, to=node, paths=[str(path) for path in paths])

    def _drop(self, user: str) -> None:
        handed = self._handed.pop(user, None)
        if handed is not None:
            asyncio.get_running_loop().run_in_executor(None, handed.snapshot.close)

    async def sweep(self, keep_s: float) -> None:
        """For good: remove the copies set aside more than ``keep_s`` ago, and snapshots of moves that never ended."""
        while True:
            await asyncio.sleep(min(600.0, max(1.0, keep_s / 2)))
            for user, handed in list(self._handed.items()):
                if time.monotonic() - handed.at > KEEP_SNAPSHOT_S:
                    self._drop(user)
            try:
                removed = await asyncio.to_thread(moved.remove_expired, self._config(), keep_s)
            except OSError as exc:
                log.error("moved_removal_failed", error=str(exc))
                continue
            if removed:
                log.info("moved_removed", paths=[str(path) for path in removed], keep_moved_s=keep_s)

    # -- the target ------------------------------------------------------------------------------

    async def _pull(self, params: dict[str, Any]) -> dict[str, Any]:
        user, epoch = check_user(params.get("user")), _epoch(params)
        source, address = params.get("from"), params.get("address")
        if not isinstance(source, str) or not isinstance(address, str):
            raise InvalidParams("users/pull needs from (the source host's name) and address (its HOST:PORT).")
        record = await self._directory.user(user)  # etcd's, not the view's: the mark may be milliseconds old
        if record is None or record.to != self.me or record.node != source or not _is_mark(record, source, epoch):
            raise InvalidParams(f"{user} is not marked moving from {source} to this host ({self.me}) at epoch "
                                f"{epoch}; a move marks them first (sandboxd users move).")
        config = self._config()
        done = await asyncio.to_thread(pull_user, config, address, source, {
            "user": user, "epoch": epoch, "waitMs": params.get("waitMs", 0)})
        log.info("move_pulled", user=user, source=source, files=done.files, bytes=done.bytes,
                 seconds=round(done.seconds, 3))
        return done.summary()

    async def _discard(self, params: dict[str, Any]) -> dict[str, Any]:
        user = check_user(params.get("user"))
        record = await self._directory.user(user)
        if record is None or record.node == self.me:
            raise InvalidParams(f"{user} is {'not in the directory' if record is None else 'served by this host'}; "
                                "only the copy of a move that did not happen is discarded.")
        removed = await asyncio.to_thread(moved.remove_user, self._config(), user)
        log.warning("move_discarded", user=user, paths=[str(path) for path in removed])
        return {"user": user, "removed": [str(path) for path in removed]}


def _is_mark(record: UserRecord | None, source: str, epoch: int) -> bool:
    return record is not None and record.state == "moving" and record.node == source and record.epoch == epoch


def _allowed(peer: Peer, method: str) -> None:
    refusal = UserTransfer.refusal(peer, method)
    if refusal is not None:
        raise PeerRefused(refusal)


def _object(method: str, params: Any) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise InvalidParams(f"{method} params must be an object, e.g. {{\"user\": \"alice@example.com\"}}.")
    return params


def _epoch(params: dict[str, Any]) -> int:
    epoch = params.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch <= 0:
        raise InvalidParams(f"epoch must be the move's mark (a positive integer), not {epoch!r}.")
    return epoch
