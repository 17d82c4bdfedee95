"""Peer credentials: the policy, the config keys, and a refused peer on a live server."""

from __future__ import annotations

import asyncio
import io
import json
import os
import socket
from pathlib import Path

import pytest

from sandboxd.config import load_config
from sandboxd.errors import ConfigError, PeerRefused
from sandboxd.logging import configure_logging
from sandboxd.sandbox.fake import FakeBackend
from sandboxd.server.server import Server
from sandboxd.service.peercred import PeerCredentials, PeerPolicy, peer_credentials
from tests.as_user import exchange_as

DAEMON_UID = 999
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")


def test_credentials_of_a_socketpair_are_our_own() -> None:
    left, right = socket.socketpair()
    with left, right:
        peer = peer_credentials(left)
    assert (peer.pid, peer.uid, peer.gid) == (os.getpid(), os.geteuid(), os.getegid())
    assert set(peer.groups) == set(os.getgroups())


@pytest.mark.parametrize(
    "uids, gids, peer, allowed",
    [
        ((), (), PeerCredentials(1, 5000, 5000), True),  # no lists: the socket's mode decides
        ((1000,), (), PeerCredentials(1, 1000, 1000), True),
        ((1000,), (), PeerCredentials(1, 5000, 5000), False),
        ((1000,), (), PeerCredentials(1, 0, 0), True),  # root
        ((1000,), (), PeerCredentials(1, DAEMON_UID, 5000), True),  # the daemon's own user
        ((), (4242,), PeerCredentials(1, 5000, 4242), True),  # primary group
        ((), (4242,), PeerCredentials(1, 5000, 5000, (27, 4242)), True),  # supplementary group
        ((), (4242,), PeerCredentials(1, 5000, 5000, (27,)), False),
    ],
)
def test_policy(uids: tuple[int, ...], gids: tuple[int, ...], peer: PeerCredentials, allowed: bool) -> None:
    assert PeerPolicy(frozenset(uids), frozenset(gids), DAEMON_UID).allows(peer) is allowed


def test_config_takes_ids_and_names() -> None:
    config = load_config(environ={"SANDBOXD_ALLOWED_UIDS": "[nobody, 1234]", "SANDBOXD_ALLOWED_GIDS": "root"})
    assert config.allowed_uids == [65534, 1234]
    assert config.allowed_gids == [0]
    with pytest.raises(ConfigError, match="no user named 'no-such-user-here'"):
        load_config(environ={"SANDBOXD_ALLOWED_UIDS": "[no-such-user-here]"})
    with pytest.raises(ConfigError, match="allowed_gids: .*no group named 'no-such-group-here'"):
        load_config(environ={"SANDBOXD_ALLOWED_GIDS": "[no-such-group-here]"})


@needs_root
def test_refused_peer_gets_one_error_and_is_disconnected_allowed_peers_are_served(tmp_path: Path, short_dir: Path) -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    socket_dir = short_dir
    socket_dir.chmod(0o755)  # so that the other uids can reach the socket at all
    config = load_config(environ={}, overrides={
        "data_path": tmp_path / "data", "socket": socket_dir / "s.sock", "seed_tools": None, "backend": "fake",
        "socket_mode": 0o666, "allowed_uids": [12345], "allowed_gids": [4242],
    })

    async def main() -> None:
        server = Server(config, FakeBackend())
        await server.startup()
        try:
            path = str(config.socket)
            refused = await asyncio.to_thread(exchange_as, path, 65534)
            by_uid = await asyncio.to_thread(exchange_as, path, 12345)
            by_group = await asyncio.to_thread(exchange_as, path, 23456, 23456, (4242,))
        finally:
            await server.shutdown()
        assert len(refused) == 1 and refused[0]["id"] is None
        assert refused[0]["error"]["code"] == PeerRefused.code == -32003
        assert "uid 65534" in refused[0]["error"]["message"] and "allowed_uids" in refused[0]["error"]["message"]
        assert by_uid == by_group == [{"jsonrpc": "2.0", "id": 1, "result": {}}]

    asyncio.run(main())
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    refusals = [e for e in events if e["event"] == "peer_refused"]
    assert len(refusals) == 1
    assert (refusals[0]["uid"], refusals[0]["gid"]) == (65534, 65534) and refusals[0]["pid"] > 0
