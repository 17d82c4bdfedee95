"""The cluster's certificates and roles (cluster/tls.py, cluster/roles.py), the listener's shares and its role
filter (server/tls_listener.py), and the dial (cluster/dial.py): in process, with openssl-made certificates.
The daemon's listener end to end is tests/cluster/test_tls_listener.py's."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from pathlib import Path
from typing import Any, Mapping

import pytest

from sandboxd.cluster.dial import DialFailed, dial, split_address
from sandboxd.cluster.roles import ALLOWED, may_call, refusal
from sandboxd.cluster.tls import Role, RoleRefused, client_context, role_of, server_context
from sandboxd.config.cluster import ClusterConfig, ClusterTLS
from sandboxd.errors import ConfigError, NotAllowed
from sandboxd.server.connection import Connection, RefusedPeers
from sandboxd.server.rpc import Method
from sandboxd.server.tls_listener import MAX_HANDSHAKES, PER_ADDRESS, TlsListener, TlsShares, handshake_failure
from sandboxd.service.fds import FdBudget
from tests.cluster.certs import Cert, ClusterCerts, make_certs


def subject(*names: str) -> dict[str, Any]:
    return {"subject": tuple(((("commonName", name),)) for name in names)}


@pytest.mark.parametrize("name, role", [("node:a", Role("node", "a")), ("router:r1", Role("router", "r1")),
                                        ("operator:ops.team-2", Role("operator", "ops.team-2"))])
def test_role_of_reads_the_common_name(name: str, role: Role) -> None:
    assert role_of(subject(name)) == role
    assert str(role_of(subject(name))) == name


@pytest.mark.parametrize("cert", [None, {}, subject(), subject("node:a", "router:r1"), subject("admin:root"),
                                  subject("node"), subject("node:"), subject("node:A"), subject("node:a:b"),
                                  subject("Node:a"), subject("node:-a"), subject("node:" + "a" * 64),
                                  {"subject": ((("organizationName", "node:a"),),)}])
def test_role_of_refuses_every_other_shape(cert: Any) -> None:
    with pytest.raises(RoleRefused):
        role_of(cert)


ROUTER, NODE, OPERATOR = Role("router", "r1"), Role("node", "b"), Role("operator", "ops")


@pytest.mark.parametrize("method, allowed", [
    ("ping", {ROUTER, NODE, OPERATOR}),
    ("tools/call", {ROUTER}), ("tools/list", {ROUTER}), ("tools/watch", {ROUTER}),
    ("sandbox/status", {ROUTER, OPERATOR}),
    ("users/export", {NODE, OPERATOR}),
    ("users/import", {OPERATOR}), ("users/move", {OPERATOR}),
    ("nodes/anything", set()), ("storage/status", set()), ("", set()),
])
def test_what_each_role_may_call(method: str, allowed: set[Role]) -> None:
    assert {role for role in (ROUTER, NODE, OPERATOR) if may_call(role, method)} == allowed


def test_a_refusal_names_the_role_the_method_and_who_may() -> None:
    refused = refusal(NODE, "tools/call")
    assert isinstance(refused, NotAllowed) and refused.code == -32006
    assert refused.data == {"role": "node:b", "method": "tools/call"}
    assert "tools/call is not allowed for node:b" in refused.message and "a router certificate" in refused.message
    assert "no certificate (the unix socket only)" in refusal(ROUTER, "storage/status").message
    assert "ping" in ALLOWED  # every certificate's


def test_shares_bound_handshakes_by_address_and_in_all() -> None:
    shares = TlsShares(limit=256, per_name=2)
    assert all(shares.begin("10.0.0.1") is None for _ in range(PER_ADDRESS))
    assert "from this address" in (shares.begin("10.0.0.1") or "")
    others = [shares.begin(f"10.0.1.{i}") for i in range(MAX_HANDSHAKES - PER_ADDRESS)]
    assert others == [None] * (MAX_HANDSHAKES - PER_ADDRESS)
    assert "handshakes are in progress" in (shares.begin("10.0.2.1") or "")
    shares.end_handshake("10.0.0.1")
    assert shares.begin("10.0.2.1") is None
    assert shares.total == MAX_HANDSHAKES


def test_shares_serve_a_name_up_to_its_share_then_refuse() -> None:
    shares = TlsShares(limit=8, per_name=2)
    for _ in range(5):
        assert shares.begin("10.0.0.1") is None
    assert [shares.settle("10.0.0.1", "router:r1") for _ in range(3)] == [True, True, False]
    assert shares.settle("10.0.0.1", None) is False  # no role: refused
    assert shares.settle("10.0.0.1", "router:r2") is True
    assert (shares.total, shares.refusing, dict(shares.served)) == (5, 2, {"router:r1": 2, "router:r2": 1})
    for name in ("router:r1", "router:r1", "router:r2", None, None):
        shares.release(name)
    assert (shares.total, dict(shares.served), dict(shares.handshakes)) == (0, {}, {})


def test_shares_call_when_room_once_a_descriptor_is_free() -> None:
    shares, resumed = TlsShares(limit=2, per_name=2), []
    shares.begin("a"), shares.begin("b")
    assert shares.full
    shares.when_room = lambda: resumed.append(True)
    shares.settle("a", "node:a")
    assert resumed == []  # still two held
    shares.release("node:a")
    assert resumed == [True] and shares.when_room is None


def test_the_listener_takes_its_share_apart_from_the_unix_clients() -> None:
    from sandboxd.config import load_config

    plain = load_config(overrides={}, environ={})
    listening = plain.model_copy(update={"cluster": ClusterConfig(
        node="a", etcd=["http://127.0.0.1:2379"], listen="127.0.0.1:7443",
        tls=ClusterTLS(cert=Path("c"), key=Path("k"), ca=Path("ca")))})
    without, with_listener = FdBudget.plan(plain, 20_000), FdBudget.plan(listening, 20_000)
    assert without.tls == 0 and with_listener.tls == 256
    assert without.clients - with_listener.clients == 256
    assert TlsShares.from_budget(with_listener).limit == 256


@pytest.mark.parametrize("exc, reason", [
    (ConnectionAbortedError("SSL handshake is taking longer than 5.0 seconds"), "no handshake within 5 s"),
    (asyncio.TimeoutError(), "no handshake within 5 s"),
    (ConnectionResetError("reset"), "handshake failed (ConnectionResetError: reset)"),
])
def test_handshake_failures_in_words(exc: BaseException, reason: str) -> None:
    assert handshake_failure(exc) == reason


# -- with real certificates -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_of(cert: Cert) -> ClusterTLS:
    return ClusterTLS(cert=cert.cert, key=cert.key, ca=cert.ca)


def test_contexts_trust_the_cluster_ca_alone_over_tls_1_3(certs: ClusterCerts) -> None:
    for context in (server_context(tls_of(certs.node_a)), client_context(tls_of(certs.router))):
        assert context.minimum_version == ssl.TLSVersion.TLSv1_3
        assert context.verify_mode == ssl.CERT_REQUIRED and not context.check_hostname
        assert [dict(ca["subject"][0])["commonName"] for ca in context.get_ca_certs()] == ["sandboxd cluster CA"]


def test_unreadable_or_mismatched_files_stop_with_the_key_named(certs: ClusterCerts, tmp_path: Path) -> None:
    good = tls_of(certs.node_a)
    with pytest.raises(ConfigError, match="cluster.tls.key: cannot read"):
        server_context(good.model_copy(update={"key": tmp_path / "missing.key"}))
    with pytest.raises(ConfigError, match="cannot be used together"):
        server_context(good.model_copy(update={"key": certs.router.key}))
    (tmp_path / "empty.pem").write_text("")
    with pytest.raises(ConfigError, match="cluster.tls.ca .* holds no CA certificate"):
        server_context(good.model_copy(update={"ca": tmp_path / "empty.pem"}))


class FakeHost:
    """The daemon as the listener sees it (connection.Edge): ping and tools/call, each answering its name."""

    def __init__(self) -> None:
        self.refused_peers = RefusedPeers()
        self.open: set[Connection] = set()

    @property
    def max_message_bytes(self) -> int:
        return 1 << 20

    def refusal(self, sock: socket.socket) -> str | None:
        return None

    def opened(self, connection: Connection) -> None:
        self.open.add(connection)

    def closed(self, connection: Connection) -> None:
        self.open.discard(connection)

    def methods(self, connection: Connection) -> Mapping[str, Method]:
        return {"ping": lambda _id, _params: {}, "tools/call": lambda _id, _params: {"called": True}}


BUDGET = FdBudget(limit=4096, reserved=256, per_sandbox=0, sandboxes=0, clients=1024, per_client=8, tls=256)


def listener_of(certs: ClusterCerts) -> tuple[TlsListener, str]:
    """A listener of node:a on a free port of 127.0.0.1, before it starts, and its address."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{probe.getsockname()[1]}"
    cluster = ClusterConfig(node="a", etcd=["http://127.0.0.1:1"], listen=address, tls=tls_of(certs.node_a))
    return TlsListener(FakeHost(), cluster, BUDGET), address


async def call_as(certs: ClusterCerts, cert: Cert, method: str) -> dict[str, Any]:
    listener, address = listener_of(certs)
    listener.start()
    try:
        reader, writer, role = await dial(address, tls_of(cert), node="a")
        assert str(role) == "node:a"
        writer.write(b'{"jsonrpc":"2.0","id":7,"method":"%s"}\n' % method.encode())
        answer: dict[str, Any] = json.loads(await reader.readline())
        writer.close()
        return answer
    finally:
        listener.close()


def test_the_role_filters_the_methods(certs: ClusterCerts) -> None:
    assert asyncio.run(call_as(certs, certs.router, "tools/call"))["result"] == {"called": True}
    refused = asyncio.run(call_as(certs, certs.node_b, "tools/call"))["error"]
    assert refused["code"] == -32006 and refused["data"] == {"role": "node:b", "method": "tools/call"}
    assert asyncio.run(call_as(certs, certs.operator, "ping"))["result"] == {}


async def dial_named(certs: ClusterCerts, node: str) -> None:
    listener, address = listener_of(certs)
    listener.start()
    try:
        await dial(address, tls_of(certs.router), node=node)
    finally:
        listener.close()


def test_a_dial_refuses_a_server_of_another_name(certs: ClusterCerts) -> None:
    with pytest.raises(DialFailed, match="is node:a, not node:b"):
        asyncio.run(dial_named(certs, "b"))


@pytest.mark.parametrize("address, parts", [("10.0.0.5:7443", ("10.0.0.5", 7443)), ("[::1]:7443", ("::1", 7443)),
                                            ("node1.example:1", ("node1.example", 1))])
def test_split_address(address: str, parts: tuple[str, int]) -> None:
    assert split_address(address) == parts


@pytest.mark.parametrize("address", ["10.0.0.5", ":7443", "a:0", "a:65536", "a:x", "a:²"])
def test_split_address_refuses(address: str) -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        split_address(address)
