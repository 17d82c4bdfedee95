"""The router's directory: the cluster's watch-fed view (cluster/view.py), with a wake-up for calls waiting
on a move, and the dial the router opens hosts with (the cluster's mutual TLS)."""

from __future__ import annotations

import asyncio
from typing import Mapping

from sandboxd.cluster.dial import dial
from sandboxd.cluster.directory import Directory as Etcd
from sandboxd.cluster.records import NodeRecord, UserRecord
from sandboxd.cluster.tls import client_context
from sandboxd.cluster.view import DirectoryView
from sandboxd.config.cluster import ClusterTLS
from sandboxd.router.upstream import Dial


class ClusterView:
    """``routing.Directory`` over etcd: lookups from the local copy, a claim as one transaction."""

    def __init__(self, etcd: Etcd) -> None:
        self._etcd = etcd
        self._view = DirectoryView(etcd, on_user=self._user_changed)
        self._changed = asyncio.Event()
        self._following: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The first read (DirectoryUnavailable when etcd does not answer), then the watch, for good."""
        await self._view.sync()
        self._following = asyncio.get_running_loop().create_task(self._view.run())

    async def close(self) -> None:
        if self._following is not None:
            self._following.cancel()
        await self._etcd.close()

    def home(self, user: str) -> UserRecord | None:
        return self._view.home(user)

    def node(self, name: str) -> NodeRecord | None:
        return self._view.node(name)

    def nodes(self) -> Mapping[str, NodeRecord]:
        return self._view.nodes()

    async def claim(self, user: str, node: str) -> UserRecord:
        record = await self._etcd.claim(user, node)
        self._view.put_user(user, record)  # the watch brings it too, later
        return record

    async def changed(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def _user_changed(self, _user: str, _old: UserRecord | None, _new: UserRecord | None) -> None:
        self._changed.set()  # every waiter wakes and looks again; the next change has a fresh event
        self._changed = asyncio.Event()


def tls_dial(tls: ClusterTLS) -> Dial:
    """Dial hosts with the router's certificate; each must show ``node:NAME`` for the name the directory gives."""
    context = client_context(tls)  # read once: ConfigError at start-up, not at the first call

    async def open_host(node: str, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer, _ = await dial(address, context, node=node)
        return reader, writer

    return open_host

