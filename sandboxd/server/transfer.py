"""``users/export`` and ``users/import``: one user's data out of this daemon and into it, as raw bytes (server/raw.py).

Who may: on the unix socket, root and the daemon's own uid only (its other clients may call
any user's tools, but a user's whole data is an operator's to move); on the cluster listener,
the certificate's role (cluster/roles.py). How an export stays consistent: a read-only btrfs
snapshot where the daemon is root and the user's folder a subvolume, taken without holding
anyone; elsewhere the user's calls are held (calls/holds.py) while the folder is streamed.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, Callable, Iterator, Mapping, Protocol

from sandboxd.config import Config
from sandboxd.errors import InvalidParams, PeerRefused
from sandboxd.logging import get_logger
from sandboxd.storage import btrfs
from sandboxd.storage.provision import sandbox_uid
from sandboxd.storage.transfer.export import ExportFailed, Snapshot, compressed, stream, take_snapshot
from sandboxd.storage.transfer.importer import Ownership, import_user
from sandboxd.storage.transfer.manifest import ArchiveRefused
from sandboxd.storage.transfer.zstd import MAGIC, BoundedZstdReader
from sandboxd.server.calls.holds import CallsStillRunning, UserHolds
from sandboxd.server.raw import Raw, RawChannel
from sandboxd.server.rpc import Method
from sandboxd.users import check_user

log = get_logger("sandboxd.transfer")

COMPRESSIONS = (None, "zstd")
ARCHIVE_OVERHEAD = 64 << 20  # headers and the manifest, beyond the files' bytes: the bound on a zstd stream's output


class Peer(Protocol):
    peer_uid: int | None  # the unix socket's peer (SO_PEERCRED); None on the cluster listener, whose roles decide


class Moves(Protocol):
    def methods(self, peer: Peer) -> Mapping[str, Method]: ...


class Cluster(Protocol):
    @property
    def moves(self) -> Moves: ...


class UserTransfer:
    def __init__(self, config: Callable[[], Config], holds: UserHolds, cluster: Cluster | None = None) -> None:
        self._config = config
        self._holds = holds
        self._cluster = cluster  # with cluster:, a move's methods too (server/moves.py): a user's data between hosts
        self._importing: set[str] = set()

    def methods(self, peer: Peer) -> Mapping[str, Method]:
        return {"users/export": lambda _id, params: self._raw(peer, "users/export", self._export, params),
                "users/import": lambda _id, params: self._raw(peer, "users/import", self._import, params),
                **(self._cluster.moves.methods(peer) if self._cluster is not None else {})}

    def _raw(self, peer: Peer, method: str, work: Callable[[RawChannel, dict[str, Any]], Any], params: Any) -> Raw:
        refusal = self.refusal(peer, method)
        if refusal is not None:
            raise PeerRefused(refusal)
        if not isinstance(params, dict):
            raise InvalidParams(f"{method} params must be an object, e.g. {{\"user\": \"alice@example.com\"}}.")
        if params.get("compress") not in COMPRESSIONS:
            raise InvalidParams(f"{method}: compress must be null or \"zstd\", not {params.get('compress')!r}.")
        return Raw(lambda channel: work(channel, params))

    @staticmethod
    def refusal(peer: Peer, method: str) -> str | None:
        """Why ``peer`` may not call ``method`` (an operator's), or None."""
        uid = peer.peer_uid
        if uid is None or uid in (0, os.getuid()):
            return None
        return (f"{method} is an operator's: uid {uid} may call tools here, but only root or the daemon's own uid "
                f"({os.getuid()}) may move a user's data. Run it as one of them (sudo sandboxd users ...).")

    # -- export ---------------------------------------------------------------------------------

    async def _export(self, channel: RawChannel, params: dict[str, Any]) -> None:
        config = self._config()
        user = check_user(params.get("user"))
        if not (config.data_path / user).is_dir():
            raise InvalidParams(f"{user} has no folder on this host ({config.data_path / user}); export them on the "
                                "host that holds them.")
        snap = await self._frozen(config, user)
        if snap is not None:
            return await self._send(channel, snap, params)
        wait_s = config.calls.max_timeout_ms / 1000 + config.calls.cancel_grace_ms / 1000
        try:
            async with self._holds.hold(user, wait_s=wait_s):
                snap = await asyncio.to_thread(take_snapshot, config, user, sandbox_uid=sandbox_uid(config),
                                               freeze=False)
                await self._send(channel, snap, params)
        except CallsStillRunning as exc:
            raise InvalidParams(f"{exc}; export again when they are done.") from None

    async def _frozen(self, config: Config, user: str) -> Snapshot | None:
        """A read-only btrfs snapshot of the user, where one can be had (root, their folder a subvolume); else None."""
        if os.geteuid() != 0 or not await asyncio.to_thread(_is_subvolume, config, user):
            return None
        snap = await asyncio.to_thread(take_snapshot, config, user, sandbox_uid=sandbox_uid(config), freeze=True)
        if snap.frozen:
            return snap
        await asyncio.to_thread(snap.close)
        return None

    async def _send(self, channel: RawChannel, snap: Snapshot, params: dict[str, Any]) -> None:
        try:
            manifest = snap.manifest
            chunks: Iterator[bytes] = stream(snap)
            if params.get("compress") == "zstd":
                chunks = compressed(chunks)
            channel.answer({"user": manifest.user, "files": sum(e.kind == "file" for e in manifest.entries),
                            "bytes": manifest.total_bytes, "compress": params.get("compress"),
                            "consistentBy": "btrfs snapshot" if snap.frozen else "calls held",
                            "email": manifest.email is not None, "skipped": snap.skipped})
            while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
                await channel.write(chunk)
        except (ExportFailed, ConnectionError, OSError) as exc:
            log.error("export_failed", user=snap.manifest.user, error=str(exc))
            raise InvalidParams(f"the export of {snap.manifest.user} failed: {exc}") from None
        finally:
            await asyncio.to_thread(snap.close)
        log.info("exported", user=snap.manifest.user, bytes=snap.manifest.total_bytes, frozen=snap.frozen)

    # -- import ---------------------------------------------------------------------------------

    async def _import(self, channel: RawChannel, params: dict[str, Any]) -> None:
        config = self._config()
        limit = _largest_quota(config) + ARCHIVE_OVERHEAD
        claimed: list[str] = []

        def claim(user: str) -> str | None:
            if user in self._importing:
                return f"{user} is being imported by another request"
            self._importing.add(user)
            claimed.append(user)
            return None

        try:
            # All of it in a worker thread, the first read (archive_reader's sniff) included: reads block.
            done = await asyncio.to_thread(lambda: import_user(config, archive_reader(channel.read, limit),
                                                               Ownership.of(config), exists=claim))
        except ConnectionError as exc:
            raise ArchiveRefused("the archive", f"{exc}: it is truncated") from None
        finally:
            self._importing.difference_update(claimed)
        log.info("imported", user=done.user, files=done.files, bytes=done.bytes, seconds=round(done.seconds, 3))
        channel.answer(done.summary())


def _is_subvolume(config: Config, user: str) -> bool:
    try:
        fd = os.open(config.data_path / user, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return os.fstat(fd).st_ino == btrfs.SUBVOLUME_ROOT_INO and btrfs.filesystem_id(fd) is not None
    finally:
        os.close(fd)


def _largest_quota(config: Config) -> int:
    storage = config.storage
    return max([storage.quota_bytes] + [own.quota_bytes for own in storage.users.values() if own.quota_bytes])


def archive_reader(read: Callable[[int], bytes], limit: int) -> Callable[[int], bytes]:
    """``read`` as the tar it carries: a zstd stream (told by its magic) decompressed, at most ``limit`` bytes."""
    head = b""
    while len(head) < len(MAGIC) and (chunk := read(len(MAGIC) - len(head))):
        head += chunk
    if head != MAGIC:
        pending = [head]

        def plain(n: int) -> bytes:
            if pending:
                return pending.pop()
            return read(n)

        return plain
    sent = [False]

    def with_magic(n: int) -> bytes:
        if not sent[0]:
            sent[0] = True
            return MAGIC
        return read(n)

    return BoundedZstdReader(with_magic, limit).read
