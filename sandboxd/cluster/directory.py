"""The directory in etcd (docs/scale.md, "Several hosts"): one aetcd client and the few operations
hosts, routers and operators need. Every operation is bounded by ``timeout_s``: a store that stops
answering (stopped, cut off) is an error, never a hang.

A user's record changes only by transactions that compare its epoch (the key's mod_revision):
the claim (create-if-absent), a move's mark, flip and abort. A record that changed meanwhile
makes the transaction fail, and the caller reads the record as it is now.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, TypeVar
from urllib.parse import urlsplit

import aetcd

from sandboxd.cluster.records import BadRecord, NodeRecord, UserRecord
from sandboxd.config.cluster import ClusterConfig
from sandboxd.errors import ConfigError, SandboxdError
from sandboxd.logging import get_logger

log = get_logger("sandboxd.cluster")

T = TypeVar("T")


class DirectoryUnavailable(SandboxdError):
    """etcd did not answer within the bound (stopped, cut off, not started)."""

    code = -32002


def endpoints(urls: list[str]) -> list[tuple[str, int]]:
    """``cluster.etcd``'s URLs as (host, port); ConfigError names one that is not http://HOST:PORT."""
    out = []
    for url in urls:
        parts = urlsplit(url if "//" in url else f"http://{url}")
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme != "http" or not parts.hostname or port is None:
            raise ConfigError(f"cluster.etcd: {url!r} is not an endpoint this version dials; write http://HOST:PORT, "
                              "e.g. http://10.0.0.5:2379 (etcd's client URL, without TLS)")
        out.append((parts.hostname, port))
    return out


@dataclass(frozen=True)
class Snapshot:
    """The whole directory at one revision: what a view starts from, and re-syncs to."""

    revision: int
    nodes: dict[str, NodeRecord]
    users: dict[str, UserRecord]


@dataclass(frozen=True)
class Change:
    """One key's change, from the watch: ``value`` None is a deletion (a node's lease expired)."""

    key: bytes
    value: bytes | None
    revision: int


class Directory:
    """The directory's keys under ``cluster.prefix``, read and written through one etcd client."""

    def __init__(self, cluster: ClusterConfig, *, timeout_s: float = 2.0) -> None:
        self.prefix = cluster.prefix.encode()
        self.urls = list(cluster.etcd)
        self._endpoints = endpoints(self.urls)
        self._next = 0  # the endpoint the next client dials
        self.timeout_s = timeout_s
        self._client = self._new_client()

    def _new_client(self) -> aetcd.Client:
        host, port = self._endpoints[self._next % len(self._endpoints)]
        self._next += 1
        # The client's own timeout only bounds a watch's creation; every call here has its own bound.
        return aetcd.Client(host=host, port=port, timeout=max(1, round(self.timeout_s)))

    async def failover(self) -> None:
        """Dial the next endpoint (the current one stopped answering); a watch on the old client ends."""
        old, self._client = self._client, self._new_client()
        await self._bounded(old.close(), "closing the old connection")

    async def close(self) -> None:
        await self._bounded(self._client.close(), "closing the connection")

    async def _bounded(self, work: Awaitable[T], what: str) -> T:
        try:
            return await asyncio.wait_for(work, self.timeout_s)
        except (asyncio.TimeoutError, aetcd.ClientError, OSError) as exc:
            raise DirectoryUnavailable(
                f"etcd ({', '.join(self.urls)}) did not answer {what} within {self.timeout_s:g} s ({type(exc).__name__}"
                f"{': ' + str(exc)[:200] if str(exc) else ''}); check that etcd runs there and cluster.etcd names it."
            ) from exc

    # -- keys ----------------------------------------------------------------------------------------

    def node_key(self, name: str) -> bytes:
        return self.prefix + b"nodes/" + name.encode()

    def drain_key(self, name: str) -> bytes:
        return self.prefix + b"draining/" + name.encode()

    def user_key(self, user: str) -> bytes:
        return self.prefix + b"users/" + user.encode()

    def parse(self, key: bytes, value: bytes, revision: int) -> NodeRecord | UserRecord | None:
        """The record a key under the prefix holds; None for a key this version does not write (logged)."""
        kind, _, name = key[len(self.prefix):].decode(errors="replace").partition("/")
        try:
            if kind == "nodes":
                return NodeRecord.load(name, value)
            if kind == "users":
                return UserRecord.load(name, value, revision)
        except BadRecord as exc:
            log.warning("cluster_bad_record", key=key.decode(errors="replace"), error=str(exc))
            return None
        return None

    # -- reads ---------------------------------------------------------------------------------------

    async def snapshot(self) -> Snapshot:
        """Every node and user, at one revision (one range read)."""
        got = await self._bounded(self._client.get_prefix(self.prefix), "a read of the directory")
        nodes: dict[str, NodeRecord] = {}
        users: dict[str, UserRecord] = {}
        for kv in got:
            record = self.parse(kv.key, kv.value, kv.mod_revision)
            if isinstance(record, NodeRecord):
                nodes[record.name] = record
            elif isinstance(record, UserRecord):
                users[record.user] = record
        return Snapshot(got.header.revision, nodes, users)

    async def user(self, user: str) -> UserRecord | None:
        got = await self._bounded(self._client.get(self.user_key(user)), f"a read of {user}'s record")
        return None if got is None else UserRecord.load(user, got.value, got.mod_revision)

    async def changes(self, after: int) -> AsyncIterator[Change]:
        """Every change under the prefix after revision ``after``, as etcd orders them, until the watch fails."""
        watch = await self._bounded(self._client.watch_prefix(self.prefix, start_revision=after + 1), "a watch")
        try:
            async for event in watch:
                kv = event.kv
                yield Change(kv.key, kv.value if event.kind == "PUT" else None, kv.mod_revision)
        finally:
            await asyncio.shield(self._cancel(watch))

    async def _cancel(self, watch: Any) -> None:
        try:
            await asyncio.wait_for(watch.cancel(), self.timeout_s)
        except Exception:  # the stream is gone already; nothing to undo
            pass

    # -- a host's registration ------------------------------------------------------------------------

    async def grant(self, ttl_s: int) -> int:
        lease = await self._bounded(self._client.lease(ttl_s), "a lease grant")
        return int(lease.id)

    async def keepalive(self, lease: int) -> int:
        """The lease's remaining TTL after the renewal; 0: etcd let it expire."""
        reply = await self._bounded(self._client.refresh_lease(lease), "a lease renewal")
        return int(reply.TTL) if reply is not None else 0

    async def revoke(self, lease: int) -> None:
        """Drop the lease and what it holds (this host's ``nodes/`` key); one etcd let expire is dropped already."""
        try:
            await self._bounded(self._client.revoke_lease(lease), "a lease revocation")
        except DirectoryUnavailable as exc:
            if "lease not found" not in str(exc.__cause__):
                raise

    async def register(self, node: NodeRecord, lease: int) -> bool:
        """Put ``nodes/<node>`` under ``lease`` if no other host holds that name now."""
        key, tx = self.node_key(node.name), self._client.transactions
        succeeded, _ = await self._bounded(self._client.transaction(
            compare=[tx.create(key) == 0], success=[tx.put(key, node.dump(), lease)], failure=[]), "a node registration")
        return bool(succeeded)

    async def draining(self, name: str) -> bool:
        """Whether an operator drained host ``name`` (``sandboxd nodes drain``): it registers as ``draining``."""
        got = await self._bounded(self._client.get(self.drain_key(name)), f"a read of {name}'s drain mark")
        return got is not None

    async def set_draining(self, name: str, draining: bool) -> NodeRecord | None:
        """Drain host ``name`` (or make it active again): a mark of its own, which outlives the host's lease and
        its restarts, and ``nodes/<name>`` rewritten under the host's lease so every view sees it now.
        The host's record as it is now; None when it is not registered (the mark holds for its next start)."""
        mark, key, tx = self.drain_key(name), self.node_key(name), self._client.transactions
        if draining:
            await self._bounded(self._client.put(mark, b"{}"), f"the drain mark of {name}")
        else:
            await self._bounded(self._client.delete(mark), f"the drain mark of {name}")
        for _ in range(5):  # the host may re-register meanwhile: read again, write again
            got = await self._bounded(self._client.get(key), f"a read of {name}'s record")
            if got is None:
                return None
            old = NodeRecord.load(name, got.value)
            new = NodeRecord(name, old.address, "draining" if draining else "active")
            succeeded, _ = await self._bounded(self._client.transaction(
                compare=[tx.mod(key) == got.mod_revision], success=[tx.put(key, new.dump(), got.lease)], failure=[]),
                f"the change of {name}'s record")
            if succeeded:
                return new
        raise DirectoryUnavailable(f"{name}'s record changed at every try; run the command again.")

    # -- a user's record -------------------------------------------------------------------------------

    async def claim(self, user: str, node: str) -> UserRecord:
        """Create ``users/<user>`` naming ``node`` if the user has no record; either way, the record now."""
        key, tx = self.user_key(user), self._client.transactions
        fresh = UserRecord(user, node, 0)
        _, responses = await self._bounded(self._client.transaction(
            compare=[tx.create(key) == 0], success=[tx.put(key, fresh.dump()), tx.get(key)],
            failure=[tx.get(key)]), f"the claim of {user}")
        ranges = [r for r in responses if isinstance(r, list)]
        value, got = ranges[-1][0]
        return UserRecord.load(user, value, got.mod_revision)

    async def replace(self, old: UserRecord, new: UserRecord) -> UserRecord | None:
        """``new`` in place of ``old`` if the record is still at ``old``'s epoch; None: it changed meanwhile."""
        key, tx = self.user_key(old.user), self._client.transactions
        succeeded, responses = await self._bounded(self._client.transaction(
            compare=[tx.mod(key) == old.epoch], success=[tx.put(key, new.dump()), tx.get(key)], failure=[]),
            f"the change of {old.user}'s record")
        if not succeeded:
            return None
        value, got = [r for r in responses if isinstance(r, list)][-1][0]
        return UserRecord.load(old.user, value, got.mod_revision)

    async def rehome(self, old: UserRecord, to: str) -> UserRecord | None:
        """Name ``to`` the home of a user whose host is down: only if the record is still at ``old``'s epoch and
        the host it names holds no lease (no key) in the same transaction; None otherwise. That host fenced
        itself before its lease expired, so it serves no call of the user while the record changes."""
        key, host, tx = self.user_key(old.user), self.node_key(old.node), self._client.transactions
        succeeded, responses = await self._bounded(self._client.transaction(
            compare=[tx.mod(key) == old.epoch, tx.create(host) == 0],
            success=[tx.put(key, UserRecord(old.user, to, 0, left=old.node).dump()), tx.get(key)], failure=[]),
            f"the rehoming of {old.user}")
        if not succeeded:
            return None
        value, got = [r for r in responses if isinstance(r, list)][-1][0]
        return UserRecord.load(old.user, value, got.mod_revision)

    async def mark_moving(self, record: UserRecord, to: str) -> UserRecord | None:
        """A move begins: new calls are refused ``moving``; None if the record changed since it was read."""
        return await self.replace(record, UserRecord(record.user, record.node, 0, "moving", to))

    async def flip(self, record: UserRecord) -> UserRecord | None:
        """A move ends: the record names the target, at a higher epoch, in one transaction."""
        assert record.state == "moving" and record.to is not None, "only a user marked moving is flipped"
        return await self.replace(record, UserRecord(record.user, record.to, 0))

    async def abort(self, record: UserRecord) -> UserRecord | None:
        """A move failed: the user is ``active`` on their host again."""
        return await self.replace(record, UserRecord(record.user, record.node, 0))
