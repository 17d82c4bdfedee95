"""The egress policy's decisions, and the proxy refusing before any connect.

Nothing here leaves the machine: names resolve through a fake resolver, and the only
connections made go to servers these tests start on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any

import pytest

from sandboxd.config import ConfigError, EgressConfig, load_config
from sandboxd.egress import proxy as proxy_module
from sandboxd.egress.policy import AllowEntry, EgressPolicy, refused_class
from sandboxd.egress.proxy import EgressProxy

PUBLIC_V4 = "93.184.215.14"  # only ever judged, never connected to
PUBLIC_V6 = "2606:2800:21f:cb07:6820:80da:af6b:8b2c"

REFUSED = [
    ("127.0.0.1", "loopback"), ("127.8.9.10", "loopback"), ("::1", "loopback"),
    ("10.0.0.5", "private address (RFC 1918)"), ("172.16.3.4", "private address (RFC 1918)"),
    ("172.31.255.255", "private address (RFC 1918)"), ("192.168.1.1", "private address (RFC 1918)"),
    ("169.254.169.254", "the cloud metadata endpoint"), ("fd00:ec2::254", "the cloud metadata endpoint"),
    ("169.254.1.1", "link-local"), ("fe80::1", "link-local"),
    ("100.64.0.1", "shared address space"), ("100.127.255.254", "shared address space"),
    ("fd12:3456::1", "unique local"), ("fc00::1", "unique local"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("ff02::1", "multicast"),
    ("0.0.0.0", "unspecified"), ("::", "unspecified"), ("255.255.255.255", "broadcast"), ("240.0.0.1", "reserved"),
    ("192.0.2.1", "not a public address"), ("198.18.0.1", "not a public address"),
    ("::ffff:10.0.0.5", "private address (RFC 1918), inside an IPv6 address"),
    ("::ffff:127.0.0.1", "loopback address, inside an IPv6 address"),
    ("64:ff9b::a00:5", "private address (RFC 1918), inside an IPv6 address"),
    ("64:ff9b::a9fe:a9fe", "the cloud metadata endpoint, inside an IPv6 address"),
    ("2002:a00:5::1", "private address (RFC 1918), inside an IPv6 address"),
]


@pytest.mark.parametrize(("address", "why"), REFUSED)
def test_every_class_that_is_not_the_public_internet_is_refused(address: str, why: str) -> None:
    assert why in (refused_class(ipaddress.ip_address(address)) or "public")
    verdict = EgressPolicy("public").for_address(address, 443, ipaddress.ip_address(address))
    assert not verdict.allowed and why in verdict.reason


@pytest.mark.parametrize("address", [PUBLIC_V4, PUBLIC_V6, "8.8.8.8", "64:ff9b::808:808"])
def test_public_addresses_pass_on_the_allowed_ports(address: str) -> None:
    policy = EgressPolicy("public")
    assert policy.for_address("example.org", 443, ipaddress.ip_address(address)).allowed
    assert policy.for_address("example.org", 80, ipaddress.ip_address(address)).allowed
    refused = policy.for_address("example.org", 25, ipaddress.ip_address(address))
    assert not refused.allowed and refused.reason == "port 25 is not in egress.ports (80, 443)"


def test_the_hosts_own_addresses_are_refused_even_when_public() -> None:
    own = ipaddress.ip_address(PUBLIC_V4)
    policy = EgressPolicy("public", host_addresses=frozenset({own}))
    assert policy.for_address(PUBLIC_V4, 443, own).reason == "an address of the daemon's own host"


def test_allow_entries_pass_private_destinations_by_name_network_and_port() -> None:
    policy = EgressPolicy("public", ["searxng.internal:8080", "10.1.2.0/24", "*.corp.test", "[fd00::5]:8443"])
    private = ipaddress.ip_address("10.9.9.9")
    assert policy.for_address("searxng.internal", 8080, private).allowed
    assert not policy.for_address("searxng.internal", 80, private).allowed  # the entry names 8080 only
    assert policy.for_address("anything", 443, ipaddress.ip_address("10.1.2.3")).allowed
    assert not policy.for_address("anything", 8080, ipaddress.ip_address("10.1.2.3")).allowed  # egress.ports
    assert policy.for_address("wiki.corp.test", 443, private).allowed
    assert not policy.for_address("corp.test", 443, private).allowed  # *. is for subdomains
    assert policy.for_address("x", 8443, ipaddress.ip_address("fd00::5")).allowed
    assert policy.before_resolving("searxng.internal", 8080, None) is None  # resolve, then judge


def test_allow_list_refuses_names_it_does_not_list_before_any_lookup() -> None:
    policy = EgressPolicy("allow-list", ["searxng.internal:8080"])
    early = policy.before_resolving("exfil-data.attacker.test", 443, None)
    assert early is not None and early.reason == "not in egress.allow"
    assert policy.before_resolving("searxng.internal", 8080, None) is None
    assert not policy.for_address("x", 443, ipaddress.ip_address(PUBLIC_V4)).allowed  # public is not enough
    # With a network in the list a name may resolve into it: then it is looked up.
    assert EgressPolicy("allow-list", ["10.1.2.0/24"]).before_resolving("db.test", 443, None) is None


def test_policy_none_refuses_everything() -> None:
    policy = EgressPolicy("none", ["127.0.0.1:8080"])
    assert policy.before_resolving("127.0.0.1", 8080, ipaddress.ip_address("127.0.0.1")) is not None
    assert not policy.for_address("127.0.0.1", 8080, ipaddress.ip_address("127.0.0.1")).allowed


@pytest.mark.parametrize(("entry", "problem"), [
    ("", "empty"), ("host:0", "is not a port"), ("host:99999", "is not a port"), ("[fd00::5", "without closing"),
    ("bad host!", "is not a host name"), ("[fd00::5]x", "after ]"),
])
def test_bad_allow_entries_are_refused_by_name(entry: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        AllowEntry.parse(entry)
    with pytest.raises(ConfigError, match=f"egress.allow: .*{problem}"):
        load_config(None, environ={"SANDBOXD_EGRESS_ALLOW": f'["{entry}"]'})


def test_the_environment_takes_the_allow_list_as_json() -> None:
    config = load_config(None, environ={"SANDBOXD_EGRESS_ALLOW": '["127.0.0.1:8080", "searxng.internal:8080"]',
                                        "SANDBOXD_EGRESS_POLICY": "allow-list"})
    assert config.egress.allow == ["127.0.0.1:8080", "searxng.internal:8080"]
    assert config.egress.policy == "allow-list" and config.sandbox.network == "none"


# --- the proxy, over real sockets ----------------------------------------------------------------

class Upstream:
    """A TCP server on 127.0.0.1 that answers HTTP/1.0 with what it was sent."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> Upstream:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        self.requests.append(head)
        body = b"hello from upstream"
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()


async def exchange(session: Any, request: bytes) -> bytes:
    """Send ``request`` through a session over a socketpair; what came back, to the end."""
    ours, theirs = socket.socketpair()
    task = asyncio.ensure_future(session.handle(theirs))
    reader, writer = await asyncio.open_connection(sock=ours)
    writer.write(request)
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await asyncio.wait_for(task, 10)
    return answer


def make_proxy(names: dict[str, list[str]] | None = None, **config: Any) -> tuple[EgressProxy, list[str]]:
    looked_up: list[str] = []

    async def resolve(host: str, port: int) -> list[Any]:
        looked_up.append(host)
        if host not in (names or {}):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address(a) for a in (names or {})[host]]

    return EgressProxy(EgressConfig(**config), resolve=resolve), looked_up


@pytest.fixture
def no_connects(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Every connection the proxy tries is recorded, and only loopback ones are made: a
    policy that let a private address through must not send a packet to it."""
    made: list[tuple[str, int]] = []
    real = asyncio.open_connection

    async def recording(host: Any = None, port: Any = None, **kwargs: Any) -> Any:
        if host is not None:
            made.append((host, port))
            if not ipaddress.ip_address(host).is_loopback:
                raise ConnectionRefusedError(111, "not connected: the test allows loopback only")
        return await real(host, port, **kwargs)

    monkeypatch.setattr(proxy_module.asyncio, "open_connection", recording)
    return made


@pytest.mark.parametrize("target", ["10.0.0.5:80", "169.254.169.254:80", "127.0.0.1:443", "[::1]:443",
                                    "[::ffff:192.168.0.1]:443", "intranet.test:443"])
def test_refusals_answer_403_naming_the_policy_before_any_connect(target: str, no_connects: list[Any]) -> None:
    async def scenario() -> None:
        proxy, _ = make_proxy({"intranet.test": ["10.1.1.1"]})
        session = proxy.session("alice@example.com", "sbx1", lambda: ("web_fetch", frozenset()))
        answer = await exchange(session, f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 403 Forbidden") and b"X-Sandboxd-Egress: refused" in head
        assert b"refused by sandboxd's egress policy: " in body and b"egress.allow" in body, body
        [(decision, reason)] = proxy.decisions  # one request, one decision, counted once
        assert decision == "refused" and f": {reason}" in body.decode() and proxy.decisions[(decision, reason)] == 1

    asyncio.run(scenario())
    assert no_connects == []


def test_a_name_resolving_to_a_private_address_is_refused_with_that_address(no_connects: list[Any]) -> None:
    async def scenario() -> bytes:
        proxy, looked_up = make_proxy({"rebind.test": ["10.1.1.1"]})
        answer = await exchange(proxy.session("a@b.c", "s", lambda: (None, frozenset())),
                                b"GET http://rebind.test/secret HTTP/1.1\r\nHost: rebind.test\r\n\r\n")
        assert looked_up == ["rebind.test"]
        return answer

    answer = asyncio.run(scenario())
    assert b"egress to rebind.test:80 refused by sandboxd's egress policy: private address (RFC 1918)" in answer
    assert no_connects == []


def test_a_listed_local_server_is_reached_by_connect_and_by_absolute_form() -> None:
    async def scenario() -> None:
        upstream = await Upstream().start()
        proxy, _ = make_proxy(allow=[f"127.0.0.1:{upstream.port}"])
        session = proxy.session("a@b.c", "s", lambda: ("t", frozenset()))
        tunnel = await exchange(session, f"CONNECT 127.0.0.1:{upstream.port} HTTP/1.1\r\n\r\n".encode()
                                + b"GET / HTTP/1.0\r\n\r\n")
        assert tunnel.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.0 200 OK"), tunnel
        forwarded = await exchange(session, f"GET http://127.0.0.1:{upstream.port}/p?q=1 HTTP/1.1\r\n"
                                            f"Host: 127.0.0.1:{upstream.port}\r\nProxy-Connection: keep-alive\r\n"
                                            "Proxy-Authorization: Basic eA==\r\n\r\n".encode())
        assert forwarded.endswith(b"hello from upstream"), forwarded
        sent = upstream.requests[-1]
        assert sent.startswith(b"GET /p?q=1 HTTP/1.1\r\n") and b"Connection: close" in sent
        assert b"Proxy-" not in sent
        assert proxy.decisions[("allowed", "egress.allow")] == 2 and session.connections == 0
        # Without the entry, the same server is loopback: refused, and it sees nothing.
        before = upstream.connections
        refused = await exchange(make_proxy()[0].session("a@b.c", "s", lambda: (None, frozenset())),
                                 f"CONNECT 127.0.0.1:{upstream.port} HTTP/1.1\r\n\r\n".encode())
        assert b"403" in refused.split(b"\r\n")[0] and upstream.connections == before

    asyncio.run(scenario())


@pytest.mark.parametrize(("request_bytes", "problem"), [
    (b"GET / HTTP/1.1\r\n\r\n", b"neither CONNECT host:port nor an absolute http:// URL"),
    (b"GET https://x.test/ HTTP/1.1\r\n\r\n", b"https goes through CONNECT"),
    (b"CONNECT x.test HTTP/1.1\r\n\r\n", b"is not host:port"),
    (b"CONNECT x.test:99999 HTTP/1.1\r\n\r\n", b"is not a port"),
    (b"CONNECT user:pw@x.test:443 HTTP/1.1\r\n\r\n", b"credentials"),
    (b"CONNECT bad_host!:443 HTTP/1.1\r\n\r\n", b"is not a host name"),
    (b"\x16\x03\x01 garbage\r\n\r\n", b"is not an HTTP/1.x request line"),
    (b"CONNECT x.test:443 HTTP/1.1\r\n folded\r\n\r\n", b"malformed (or folded)"),
    (b"CONNECT x.test:443 HTTP/1.1\r\n" + b"X: " + b"a" * 20000 + b"\r\n\r\n", b"exceeds"),
])
def test_malformed_requests_get_400_naming_the_problem(request_bytes: bytes, problem: bytes) -> None:
    async def scenario() -> bytes:
        proxy, looked_up = make_proxy()
        answer = await exchange(proxy.session("a@b.c", "s", lambda: (None, frozenset())), request_bytes)
        assert looked_up == []
        return answer

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 400 Bad Request") and problem in answer, answer


def test_an_unknown_name_and_a_refused_port_fail_with_502_and_a_reason() -> None:
    async def scenario() -> None:
        proxy, _ = make_proxy()
        session = proxy.session("a@b.c", "s", lambda: (None, frozenset()))
        answer = await exchange(session, b"CONNECT nowhere.test:443 HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 502") and b"X-Sandboxd-Egress: failed" in answer
        assert b"egress to nowhere.test:443 failed: the name does not resolve" in answer
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # nothing listens there now
        allowed, _ = make_proxy(allow=[f"127.0.0.1:{port}"])
        answer = await exchange(allowed.session("a@b.c", "s", lambda: (None, frozenset())),
                                f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 502") and b"failed: connection refused" in answer, answer

    asyncio.run(scenario())


def test_a_sandbox_holds_at_most_max_connections_and_close_ends_them() -> None:
    async def scenario() -> None:
        proxy, _ = make_proxy(max_connections=2)
        session = proxy.session("a@b.c", "s", lambda: (None, frozenset()))
        held = []
        for _ in range(2):  # two connections that never finish their request head
            ours, theirs = socket.socketpair()
            held.append((ours, asyncio.ensure_future(session.handle(theirs))))
        await asyncio.sleep(0.05)
        assert session.connections == 2 and "connections=2" in repr(session)
        answer = await exchange(session, b"CONNECT x.test:443 HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503") and b"egress.max_connections" in answer
        session.close()
        await asyncio.wait_for(asyncio.gather(*(task for _, task in held)), 5)
        assert session.connections == 0
        for ours, _ in held:
            assert ours.recv(100) == b""  # closed by the proxy
            ours.close()

    asyncio.run(scenario())


def test_the_log_names_user_tool_and_decision_and_masks_secrets() -> None:
    import io

    from sandboxd.logging import configure_logging

    stream = io.StringIO()  # stays open for whatever logs after this test
    configure_logging("info", "json", stream=stream)
    token = "tok-9f8e7d6c5b4a"

    async def scenario() -> None:
        proxy, _ = make_proxy()
        session = proxy.session("alice@example.com", "sbx1", lambda: ("web_fetch", frozenset({token})))
        await exchange(session, f"CONNECT {token}.10.0.0.5.test:443 HTTP/1.1\r\n\r\n".encode())
        await exchange(session, b"CONNECT 10.0.0.5:80 HTTP/1.1\r\n\r\n")

    asyncio.run(scenario())
    logged = stream.getvalue()
    assert token not in logged
    assert '"event": "egress"' in logged and '"user": "alice@example.com"' in logged
    assert '"tool": "web_fetch"' in logged and '"decision": "refused"' in logged and '"port": 80' in logged


def test_a_sandboxs_traffic_is_held_to_egress_rate_bytes() -> None:
    """3 MiB at 1 MiB/s (one second's worth at once) takes at least 2 s; only a lower bound, so never flaky."""
    size = 3 << 20

    async def scenario() -> float:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"x" * size)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        proxy, _ = make_proxy(allow=[f"127.0.0.1:{port}"], rate_bytes=1 << 20)
        started = asyncio.get_running_loop().time()
        answer = await exchange(proxy.session("a@b.c", "s", lambda: (None, frozenset())),
                                f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\nGET / HTTP/1.0\r\n\r\n".encode())
        assert answer.endswith(b"x" * 1000) and len(answer) > size
        server.close()
        return asyncio.get_running_loop().time() - started

    assert asyncio.run(scenario()) >= 1.9


@pytest.mark.parametrize("name", ["HOME", "OFFICER_EMAIL_DB", "PI_TOOLS_DIRS", "HTTPS_PROXY", "http_proxy",
                                  "NO_PROXY", "SANDBOXD_EGRESS_SOCKET", "SANDBOXD_ANYTHING"])
def test_a_call_cannot_set_the_sandbox_contract_or_the_proxy_variables(name: str) -> None:
    """Even when an operator lists them in calls.allowed_env: a call could otherwise point its
    children's HTTPS_PROXY elsewhere (where no route leads anyway) or confuse the shim."""
    from sandboxd.errors import InvalidParams
    from sandboxd.server.calls import _check_env

    with pytest.raises(InvalidParams, match=f"{name} is set by sandboxd and cannot be overridden"):
        _check_env({name: "x"}, [name])
    assert _check_env({"PI_SEARXNG_URL": "http://127.0.0.1:8888"}, ["PI_SEARXNG_URL"])


def test_one_sandbox_holds_at_most_two_lookups_even_after_they_time_out(no_connects: list[Any]) -> None:
    """A slow name's lookup keeps its thread after the request gave up: it still counts, so one
    sandbox's slow names cannot take every DNS thread from the others."""

    async def scenario() -> None:
        release = asyncio.Event()
        running: list[str] = []

        async def slow(host: str, port: int) -> list[Any]:
            running.append(host)
            await release.wait()
            return [ipaddress.ip_address("10.0.0.5")]  # refused by class: nothing is connected to

        proxy = EgressProxy(EgressConfig(connect_timeout_ms=200), resolve=slow)
        hostile = proxy.session("a@b.c", "s1", lambda: (None, frozenset()))
        answers = await asyncio.gather(*(exchange(hostile, f"CONNECT slow{i}.test:443 HTTP/1.1\r\n\r\n".encode())
                                         for i in range(3)))
        assert all(a.startswith(b"HTTP/1.1 504") for a in answers), answers  # all gave up after 200 ms
        assert sorted(running) == ["slow0.test", "slow1.test"]  # the third never got a lookup
        late = await exchange(hostile, b"CONNECT slow3.test:443 HTTP/1.1\r\n\r\n")
        assert late.startswith(b"HTTP/1.1 504") and len(running) == 2  # still held: their threads run on
        other = asyncio.ensure_future(exchange(proxy.session("b@b.c", "s2", lambda: (None, frozenset())),
                                               b"CONNECT other.test:443 HTTP/1.1\r\n\r\n"))
        await asyncio.sleep(0.05)
        assert "other.test" in running  # another sandbox looks up at once
        release.set()
        assert b"private address" in await other

    asyncio.run(scenario())
    assert no_connects == []
