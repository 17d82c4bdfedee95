"""The cluster listener end to end (issue 46, item 3): a real daemon with ``cluster.listen`` on 127.0.0.1,
certificates made with openssl, real TLS clients and raw sockets, and real tools through Docker.

Every test also shows the listener serving a certificate it should (a router's ping, say), so
none passes where nothing listens. One daemon serves the whole module (~25 s in all, most of
it the silent peer's 5-s deadline and the first call's sandbox).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from sandboxd.async_client import AsyncClient
from sandboxd.client import Client
from sandboxd.cluster.dial import DialFailed, connect_node, dial
from sandboxd.config.cluster import ClusterTLS
from sandboxd.server.tls_listener import HANDSHAKE_S, PER_ADDRESS
from sandboxd.wire import RpcError
from tests.cluster.certs import Cert, ClusterCerts, make_certs
from tests.cluster.etcd import Etcd, free_port
from tests.e2e.conftest import REPO, Daemon, docker_api  # noqa: F401  (a fixture)
from tests.e2e.hostile_harness import wait_until

pytestmark = pytest.mark.docker

USER = "alice@example.com"
PING = b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n'


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> ClusterCerts:
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, certs: ClusterCerts, docker_api: Any) -> Iterator[Daemon]:  # noqa: F811
    port, store = free_port(), Etcd().start()
    daemon = Daemon(tmp_path_factory.mktemp("node-a"), config=(
        "pool:\n  min_idle: 0\n"
        f"cluster:\n  node: a\n  etcd: ['{store.url}']\n  listen: 127.0.0.1:{port}\n"
        + certs.node_a.tls_yaml()))
    daemon.address = f"127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        yield daemon.start()
    finally:
        daemon.stop()
        store.stop()
        daemon.remove_leftovers(docker_api)


def address(node: Daemon) -> str:
    return str(node.address)  # type: ignore[attr-defined]


def tls_of(cert: Cert) -> ClusterTLS:
    return ClusterTLS(cert=cert.cert, key=cert.key, ca=cert.ca)


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


async def ping_as(node: Daemon, cert: Cert) -> Any:
    client = await connect_node(address(node), tls_of(cert), node="a")
    try:
        return await client.call("ping")
    finally:
        await client.close()


def raw_exchange(node: Daemon, cert: Cert | None, trust: Path) -> bytes:
    """A TLS client with ``cert`` (or none) sends a ping; every byte of the answer, decrypted, until the close."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(trust)
    if cert is not None:
        context.load_cert_chain(cert.cert, cert.key)
    host, port = address(node).split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        with context.wrap_socket(raw) as tls:  # TLS 1.3: the client's handshake ends before the server checks it
            try:
                tls.sendall(PING)
                while chunk := tls.recv(4096):
                    received += chunk
            except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
                pass  # the server's alert, or its close
    return received


def plain_exchange(node: Daemon, data: bytes) -> bytes:
    host, port = address(node).split(":")
    received = b""
    with socket.create_connection((host, int(port)), timeout=10) as raw:
        raw.sendall(data)
        try:
            while chunk := raw.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
    return received


def refusals(node: Daemon) -> list[str]:
    return [event["reason"] for event in node.events("tls_peer_refused")]


def wait_for(condition: Any, what: str, node: Daemon, timeout: float = 10) -> Any:
    try:
        return wait_until(condition, timeout, what, interval=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{node.log()}") from None


def test_ping_answers_every_role_the_ca_signed(node: Daemon, certs: ClusterCerts) -> None:
    for cert in (certs.node_b, certs.router, certs.operator):
        assert run(ping_as(node, cert)) == {}
    roles = {event["role"] for event in node.events("tls_peer")}
    assert {"node:b", "router:r1", "operator:ops"} <= roles


def test_certificates_the_cluster_did_not_sign_get_nothing(node: Daemon, certs: ClusterCerts, tmp_path: Path) -> None:
    assert run(ping_as(node, certs.router)) == {}  # the listener is there, and lets the cluster's router in
    expired = certs.ca.issue("router:late", days=-1)
    for cert in (None, certs.foreign_router, expired):
        assert raw_exchange(node, cert, certs.ca.cert) == b""
    for data in (PING, b"GET / HTTP/1.1\r\nHost: a\r\n\r\n"):
        assert b"jsonrpc" not in plain_exchange(node, data)
    reasons = wait_for(lambda: refusals(node) if len(refusals(node)) >= 5 else None, "five refusals logged", node)
    assert "no certificate" in reasons
    assert "certificate refused: unable to get local issuer certificate" in reasons  # the foreign CA's
    assert "certificate refused: certificate has expired" in reasons
    assert any(reason.startswith("not TLS") for reason in reasons)
    # The dialling side names what went wrong.
    for cert in (certs.foreign_router, expired):
        with pytest.raises(DialFailed, match="refused this side's certificate"):
            run(ping_as(node, cert))


def test_a_certificate_of_no_role_is_refused(node: Daemon, certs: ClusterCerts) -> None:
    nobody = certs.ca.issue("admin:root")
    answer = [json.loads(line) for line in raw_exchange(node, nobody, certs.ca.cert).splitlines()]
    assert [message["error"]["code"] for message in answer] == [-32003]
    assert "names no role" in answer[0]["error"]["message"]
    assert any(reason.startswith("bad role") for reason in refusals(node))
    assert run(ping_as(node, certs.router)) == {}


def test_a_router_calls_tools_sees_progress_and_cancels(node: Daemon, certs: ClusterCerts) -> None:
    async def calls() -> tuple[Any, list[Any], Any]:
        client = await connect_node(address(node), tls_of(certs.router), node="a")
        try:
            listed = await client.call("tools/list", {"user": USER})
            assert "progress" in {tool["name"] for tool in listed["tools"]}
            progress: list[Any] = []
            _, future = await client.request("tools/call", {"user": USER, "name": "progress", "arguments": {"steps": 3}},
                                             on_progress=progress.append)
            done = await asyncio.wait_for(future, 60)
            request_id, sleeping = await client.request(
                "tools/call", {"user": USER, "name": "sleeper", "arguments": {"ms": 30_000}})
            await asyncio.sleep(1.0)
            client.cancel(request_id, "the router's client went away")
            cancelled = await asyncio.wait_for(sleeping, 20)
            return done, progress, cancelled
        finally:
            await client.close()

    done, progress, cancelled = run(calls())
    assert done["status"] == "ok" and done["content"][0]["text"] == "did 3 steps"
    assert len(progress) == 3
    assert cancelled["status"] == "cancelled"


def test_a_node_or_operator_may_not_call_tools(node: Daemon, certs: ClusterCerts) -> None:
    before = node.client().request("sandbox/status")["calls"]

    async def attempt(cert: Cert, method: str, params: dict[str, Any]) -> RpcError:
        client = await connect_node(address(node), tls_of(cert), node="a")
        try:
            with pytest.raises(RpcError) as refused:
                await client.call(method, params)
            return refused.value
        finally:
            await client.close()

    call = {"user": USER, "name": "progress", "arguments": {"steps": 1}}
    for cert, role in ((certs.node_b, "node:b"), (certs.operator, "operator:ops")):
        refused = run(attempt(cert, "tools/call", call))
        assert refused.code == -32006
        assert refused.data == {"role": role, "method": "tools/call"}
        assert f"tools/call is not allowed for {role}" in refused.message
    refused = run(attempt(certs.node_b, "sandbox/status", {}))
    assert refused.data == {"role": "node:b", "method": "sandbox/status"}
    assert node.client().request("sandbox/status")["calls"] == before  # a refused call started nothing

    async def status_as_operator() -> Any:
        client = await connect_node(address(node), tls_of(certs.operator), node="a")
        try:
            return await client.call("sandbox/status")
        finally:
            await client.close()

    assert "pool" in run(status_as_operator())


def test_dialling_checks_the_server_is_the_node_named(node: Daemon, certs: ClusterCerts) -> None:
    with pytest.raises(DialFailed, match="is node:a, not node:b"):
        run(dial(address(node), tls_of(certs.router), node="b"))
    reader_writer = run(_dial_and_close(node, certs.router))
    assert reader_writer == "node:a"


async def _dial_and_close(node: Daemon, cert: Cert) -> str:
    _, writer, role = await dial(address(node), tls_of(cert), node="a")
    writer.close()
    return str(role)


def test_a_silent_peer_is_dropped_at_the_handshake_deadline(node: Daemon, certs: ClusterCerts) -> None:
    host, port = address(node).split(":")
    with socket.create_connection((host, int(port)), timeout=HANDSHAKE_S + 10) as silent:
        started = time.monotonic()
        assert silent.recv(4096) == b""  # closed by the daemon, having sent nothing
        waited = time.monotonic() - started
    assert HANDSHAKE_S - 1 <= waited <= HANDSHAKE_S + 5, waited
    wait_for(lambda: f"no handshake within {HANDSHAKE_S:g} s" in refusals(node), "the deadline logged", node)
    assert run(ping_as(node, certs.router)) == {}


def test_idle_handshakes_take_nothing_from_the_unix_socket(node: Daemon, certs: ClusterCerts) -> None:
    host, port = address(node).split(":")
    pid = node.proc.pid  # type: ignore[union-attr]
    fds_before, threads_before = len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))
    flood = []
    try:
        for _ in range(200):  # one peer (127.0.0.2), connecting and saying nothing
            sock = socket.socket()
            sock.bind(("127.0.0.2", 0))
            sock.connect((host, int(port)))
            flood.append(sock)
        # The log's budget keeps a few of the refusals' lines; the excess is closed at once all the same.
        wait_for(lambda: sum(r.endswith("in progress already") for r in refusals(node)) >= 50,
                 "the flood's excess refused", node)
        held = wait_for(lambda: [n for n in [len(os.listdir(f"/proc/{pid}/fd")) - fds_before] if n <= PER_ADDRESS + 4],
                        "the daemon holding no more than the flood's share", node)
        assert held[0] >= PER_ADDRESS - 4  # its handshakes in progress, held until the deadline
        assert len(os.listdir(f"/proc/{pid}/task")) - threads_before <= 2  # no thread per handshake
        with Client(node.socket, timeout=10) as unix_client:  # the unix socket's clients still get in
            assert unix_client.request("ping") == {}
        assert run(ping_as(node, certs.router)) == {}  # and so does a router, from another address
    finally:
        for sock in flood:
            sock.close()
    # Every descriptor the flood cost is given back once it goes (the handshakes fail at its close).
    wait_for(lambda: len(os.listdir(f"/proc/{pid}/fd")) <= fds_before + 2, "the flood's descriptors freed", node)


def test_sandboxd_status_reaches_the_node_with_an_operator_certificate(node: Daemon, certs: ClusterCerts,
                                                                         tmp_path: Path) -> None:
    def status_as(cert: Cert) -> subprocess.CompletedProcess[str]:
        config = tmp_path / f"{cert.cert.stem}.yaml"  # an operator's: the cluster section without node
        config.write_text("cluster:\n  etcd: ['http://127.0.0.1:1']\n" + cert.tls_yaml())
        environ = {k: v for k, v in os.environ.items() if not k.startswith("SANDBOXD_")}
        return subprocess.run([sys.executable, "-m", "sandboxd", "status", "--config", str(config),
                               "--node-address", address(node), "--json"],
                              capture_output=True, text=True, timeout=60, env=environ, cwd=REPO)

    done = status_as(certs.operator)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["pool"]["totals"] is not None
    refused = status_as(certs.node_b)
    assert refused.returncode == 2 and refused.stdout == ""
    assert "sandbox/status is not allowed for node:b" in refused.stderr
