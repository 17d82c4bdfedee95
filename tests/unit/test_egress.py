"""The egress policy's decisions, and the proxy refusing before any connect.

Nothing here leaves the machine: names resolve through a fake resolver, and the only
connections made go to servers these tests start on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
from typing import Any

import pytest

from sandboxd.config import ConfigError, EgressConfig, load_config
from sandboxd.egress import session as session_module
from sandboxd.egress.contract import EgressCall
from sandboxd.egress.proxy import EgressProxy
from sandboxd.rules.addresses import IPV4_SPECIAL, IPV6_CARRIERS, IPV6_SPECIAL, OWN_HOST, SCOPED, refused_class
from sandboxd.rules.policy import AllowEntry, EgressPolicy
from sandboxd.rules.secrets import StandIns

PUBLIC_V4 = "93.184.215.14"  # only ever judged, never connected to
PUBLIC_V6 = "2606:2800:21f:cb07:6820:80da:af6b:8b2c"

RFC1918 = "private address (RFC 1918)"
LOOPBACK4 = "loopback address (RFC 1122)"
METADATA = "the cloud metadata endpoint"
SPECIAL = "special-purpose address"

# Each range of IANA's IPv4 special-purpose registry (and multicast, metadata), with the exact reason.
REFUSED_V4 = [
    ("0.0.0.0", "unspecified address (RFC 1122)"), ("0.1.2.3", "unspecified address (RFC 791)"),
    ("10.0.0.5", RFC1918), ("10.255.255.255", RFC1918),
    ("100.64.0.1", "shared address space (RFC 6598, carrier-grade NAT)"),
    ("100.127.255.254", "shared address space (RFC 6598, carrier-grade NAT)"),
    ("127.0.0.1", LOOPBACK4), ("127.8.9.10", LOOPBACK4),
    ("169.254.1.1", "link-local address (RFC 3927)"), ("169.254.169.254", METADATA),
    ("168.63.129.16", "the cloud metadata endpoint (Azure WireServer)"),
    ("172.16.3.4", RFC1918), ("172.31.255.255", RFC1918),
    ("192.0.0.1", f"{SPECIAL} (IPv4 service continuity, RFC 7335)"),
    ("192.0.0.8", f"{SPECIAL} (IPv4 dummy address, RFC 7600)"),
    ("192.0.0.9", f"{SPECIAL} (PCP anycast, RFC 7723)"), ("192.0.0.10", f"{SPECIAL} (TURN anycast, RFC 8155)"),
    ("192.0.0.170", f"{SPECIAL} (NAT64/DNS64 discovery, RFC 8880)"),
    ("192.0.0.192", f"{SPECIAL} (IETF protocol assignments, RFC 6890)"),  # Oracle Cloud's metadata
    ("192.0.2.1", "documentation address (RFC 5737)"), ("198.51.100.7", "documentation address (RFC 5737)"),
    ("203.0.113.255", "documentation address (RFC 5737)"),
    ("192.31.196.1", f"{SPECIAL} (AS112, RFC 7535)"), ("192.52.193.1", f"{SPECIAL} (AMT, RFC 7450)"),
    ("192.88.99.1", f"{SPECIAL} (6to4 relay anycast, RFC 7526)"),
    ("192.88.99.2", f"{SPECIAL} (6a44 relay anycast, RFC 6751)"),
    ("192.168.1.1", RFC1918), ("192.175.48.6", f"{SPECIAL} (AS112, RFC 7534)"),
    ("198.18.0.1", "benchmarking address (RFC 2544)"), ("198.19.255.255", "benchmarking address (RFC 2544)"),
    ("224.0.0.1", "multicast address (RFC 5771)"), ("239.255.255.250", "multicast address (RFC 5771)"),
    ("240.0.0.1", "reserved address (RFC 1112)"), ("255.255.255.254", "reserved address (RFC 1112)"),
    ("255.255.255.255", "broadcast address (RFC 919)"),
]

# Each range of IANA's IPv6 special-purpose registry, what lies outside 2000::/3, and every
# form that carries an IPv4 address, judged by that address.
REFUSED_V6 = [
    ("::", "unspecified address (RFC 4291)"), ("::1", "loopback address (RFC 4291)"),
    ("100::1", f"{SPECIAL} (discard-only, RFC 6666)"), ("100:0:0:1::1", f"{SPECIAL} (dummy prefix, RFC 9780)"),
    ("2001:5::1", f"{SPECIAL} (IETF protocol assignments, RFC 2928)"),
    ("2001:1::1", f"{SPECIAL} (PCP anycast, RFC 7723)"), ("2001:1::2", f"{SPECIAL} (TURN anycast, RFC 8155)"),
    ("2001:1::3", f"{SPECIAL} (DNS-SD SRP anycast, RFC 9665)"), ("2001:2::1", "benchmarking address (RFC 5180)"),
    ("2001:3::1", f"{SPECIAL} (AMT, RFC 7450)"), ("2001:4:112::1", f"{SPECIAL} (AS112, RFC 7535)"),
    ("2001:10::1", f"{SPECIAL} (ORCHID, RFC 4843)"), ("2001:20::1", f"{SPECIAL} (ORCHIDv2, RFC 7343)"),
    ("2001:30::1", f"{SPECIAL} (drone remote ID, RFC 9374)"),
    ("2001:db8::1", "documentation address (RFC 3849)"), ("2620:4f:8000::42", f"{SPECIAL} (AS112, RFC 7534)"),
    ("3fff::1", "documentation address (RFC 9637)"), ("3fff:fff:ffff::1", "documentation address (RFC 9637)"),
    ("5f00::1", f"{SPECIAL} (SRv6 SIDs, RFC 9602)"),
    ("fc00::1", "unique local address (RFC 4193)"), ("fd12:3456::1", "unique local address (RFC 4193)"),
    ("fd00:ec2::254", METADATA), ("fe80::1", "link-local address (RFC 4291)"),
    ("fec0::1", "site-local address (RFC 3879)"), ("ff02::1", "multicast address (RFC 4291)"),
    ("ff0e::1", "multicast address (RFC 4291)"),
    # outside 2000::/3: reserved, and nothing the registry names
    ("4000::1", "not a global unicast address (outside 2000::/3, RFC 4291)"),
    ("1234::1", "not a global unicast address (outside 2000::/3, RFC 4291)"),
    ("64:ff9b:2::a00:1", "not a global unicast address (outside 2000::/3, RFC 4291)"),
    ("::ffff:1:0:a00:1", "not a global unicast address (outside 2000::/3, RFC 4291)"),
    # IPv4-mapped, ::ffff:0:0/96
    ("::ffff:10.0.0.5", f"{RFC1918}, inside an IPv4-mapped address (10.0.0.5)"),
    ("::ffff:127.0.0.1", f"{LOOPBACK4}, inside an IPv4-mapped address (127.0.0.1)"),
    ("::ffff:a9fe:a9fe", f"{METADATA}, inside an IPv4-mapped address (169.254.169.254)"),
    # IPv4-compatible, ::/96 (deprecated)
    ("::a9fe:a9fe", f"{METADATA}, inside an IPv4-compatible address (169.254.169.254)"),
    ("::7f00:1", f"{LOOPBACK4}, inside an IPv4-compatible address (127.0.0.1)"),
    ("::2", "unspecified address (RFC 791), inside an IPv4-compatible address (0.0.0.2)"),
    ("::c0a8:101", f"{RFC1918}, inside an IPv4-compatible address (192.168.1.1)"),
    # IPv4-translated, ::ffff:0:0:0/96 (SIIT)
    ("::ffff:0:7f00:1", f"{LOOPBACK4}, inside an IPv4-translated address (127.0.0.1)"),
    ("::ffff:0:a9fe:a9fe", f"{METADATA}, inside an IPv4-translated address (169.254.169.254)"),
    # NAT64, the well-known prefix 64:ff9b::/96
    ("64:ff9b::a00:5", f"{RFC1918}, inside a NAT64 address (10.0.0.5)"),
    ("64:ff9b::a9fe:a9fe", f"{METADATA}, inside a NAT64 address (169.254.169.254)"),
    ("64:ff9b::7f00:1", f"{LOOPBACK4}, inside a NAT64 address (127.0.0.1)"),
    # NAT64, local use 64:ff9b:1::/48: the /96 reading, and the /64, /56, /48 ones of RFC 6052
    ("64:ff9b:1::a00:1", f"{RFC1918}, inside a local-use NAT64 address (10.0.0.1)"),
    ("64:ff9b:1:0:a:0:100:0", f"{RFC1918}, inside a local-use NAT64 address (10.0.0.1 read as /64)"),
    ("64:ff9b:1:8c0:a8:101:808:808", f"{RFC1918}, inside a local-use NAT64 address (192.168.1.1 read as /56)"),
    ("64:ff9b:1:a08:8:808:808:808", f"{RFC1918}, inside a local-use NAT64 address (10.8.8.8 read as /48)"),
    # 6to4, 2002::/16
    ("2002:a00:5::1", f"{RFC1918}, inside a 6to4 address (10.0.0.5)"),
    ("2002:a9fe:a9fe::1", f"{METADATA}, inside a 6to4 address (169.254.169.254)"),
    ("2002:7f00:1::", f"{LOOPBACK4}, inside a 6to4 address (127.0.0.1)"),
    # Teredo, 2001::/32: the client is the inverted low 32 bits, the server bits 32-63
    ("2001:0:808:808::f5ff:fffe", f"{RFC1918}, inside a Teredo address (client 10.0.0.1)"),
    ("2001:0:808:808::5601:5601", f"{METADATA}, inside a Teredo address (client 169.254.169.254)"),
    ("2001:0:a00:1::f7f7:f7f7", f"{RFC1918}, inside a Teredo address (server 10.0.0.1)"),
    ("2001:0:7f00:1::f7f7:f7f7", f"{LOOPBACK4}, inside a Teredo address (server 127.0.0.1)"),
]

# Public, and the IPv4-carrying forms of a public address: judged, never connected to.
PUBLIC = [PUBLIC_V4, PUBLIC_V6, "8.8.8.8", "1.1.1.1", "2606:4700::1111", "2001:4860:4860::8888", "2c0f:fb50::1",
          "::ffff:8.8.8.8", "::8.8.8.8", "::ffff:0:8.8.8.8", "64:ff9b::8.8.8.8", "2002:808:808::1",
          "2001:0:808:404::f7f7:f7f7",  # Teredo: server 8.8.4.4, client 8.8.8.8
          "64:ff9b:1:808:8:808:808:808",  # local-use NAT64 whose every reading is 8.8.8.8
          "2001:200::1", "3fff:1000::1", "2620:4f:8001::1"]  # just past 2001::/23, 3fff::/20, 2620:4f:8000::/48

# What the metrics may be labelled with: the class words, never an address or a range.
LABELS = {"unspecified address", "private address", "shared address space", "loopback address",
          "link-local address", "the cloud metadata endpoint", SPECIAL, "documentation address",
          "benchmarking address", "multicast address", "reserved address", "broadcast address",
          "unique local address", "site-local address", "not a global unicast address"}


@pytest.mark.parametrize(("address", "why"), REFUSED_V4 + REFUSED_V6)
def test_every_special_purpose_range_and_every_form_carrying_one_is_refused_naming_it(address: str,
                                                                                       why: str) -> None:
    assert refused_class(ipaddress.ip_address(address)) == why
    verdict = EgressPolicy("public").for_address(address, 443, ipaddress.ip_address(address))
    assert not verdict.allowed and verdict.reason == why
    assert session_module._reason_label(why) in LABELS


@pytest.mark.parametrize(("entries", "name"), [(IPV4_SPECIAL, "IPv4"), (IPV6_SPECIAL, "IPv6")])
def test_both_ends_of_every_range_in_the_tables_are_refused(entries: Any, name: str) -> None:
    """A longer prefix inside a range names itself; nothing in a range is public."""
    for net, _words, _source in entries:
        network = ipaddress.ip_network(net)
        for address in (network.network_address, network.broadcast_address):
            assert refused_class(address) is not None, (name, net, address)


def test_python_s_own_tables_find_nothing_non_global_that_the_policy_allows() -> None:
    """The registries, not ``is_global``, decide; but whatever Python 3.11 calls non-global (a
    seeded sample of the whole IPv4 space, the IPv6 one and the boundaries of both tables) is
    refused here too, but for the forms judged by the public IPv4 address they carry."""
    rng = random.Random(27)
    sample: list[Any] = [ipaddress.IPv4Address(rng.getrandbits(32)) for _ in range(20000)]
    sample += [ipaddress.IPv6Address(rng.getrandbits(128)) for _ in range(5000)]
    sample += [ipaddress.IPv6Address((0x2 << 124) | rng.getrandbits(125)) for _ in range(5000)]  # 2000::/3
    networks = [ipaddress.ip_network(net) for net, _w, _s in IPV4_SPECIAL + IPV6_SPECIAL]
    networks += [ipaddress.ip_network(net) for net, _f, _c in IPV6_CARRIERS]
    for network in networks:  # each range's ends, and the addresses just outside it
        first, last = int(network.network_address), int(network.broadcast_address)
        sample += [type(network.network_address)(value) for value in (first - 1, first, last, last + 1)
                   if 0 <= value < 1 << network.max_prefixlen]
    carriers = [ipaddress.ip_network(net) for net, _f, _c in IPV6_CARRIERS]
    for address in sample:
        if not address.is_global and not any(address in carrier for carrier in carriers):
            assert refused_class(address) is not None, address
        if isinstance(address, ipaddress.IPv4Address) and refused_class(address) is None:
            assert address.is_global and not address.is_multicast, address


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass_on_the_allowed_ports(address: str) -> None:
    policy = EgressPolicy("public")
    assert refused_class(ipaddress.ip_address(address)) is None
    assert policy.for_address("example.org", 443, ipaddress.ip_address(address)).allowed
    assert policy.for_address("example.org", 80, ipaddress.ip_address(address)).allowed
    refused = policy.for_address("example.org", 25, ipaddress.ip_address(address))
    assert not refused.allowed and refused.reason == "port 25 is not in egress.ports (80, 443)"


def test_the_hosts_own_addresses_are_refused_even_when_public() -> None:
    own = ipaddress.ip_address(PUBLIC_V4)
    policy = EgressPolicy("public", host_addresses=frozenset({own}))
    assert policy.for_address(PUBLIC_V4, 443, own).reason == OWN_HOST
    # ... and inside an IPv6 form that carries it
    mapped = ipaddress.ip_address(f"::ffff:{PUBLIC_V4}")
    assert policy.for_address(str(mapped), 443, mapped).reason == f"{OWN_HOST}, inside an IPv4-mapped address ({own})"


def test_a_scoped_literal_is_refused_and_the_host_check_ignores_scopes() -> None:
    own = ipaddress.ip_address(PUBLIC_V6)
    policy = EgressPolicy("public", host_addresses=frozenset({own}))
    for text in (f"{PUBLIC_V6}%1", "2606:4700::1111%eth0", "fe80::1%eth0", "::1%lo", "::ffff:10.0.0.5%1"):
        verdict = policy.for_address(text, 443, ipaddress.ip_address(text))
        assert not verdict.allowed and verdict.reason == SCOPED, text
    # The check itself compares without scope (frozenset membership would not).
    assert ipaddress.ip_address(f"{PUBLIC_V6}%1") not in policy.host_addresses
    assert refused_class(ipaddress.ip_address(f"{PUBLIC_V6}%1"), policy.host_addresses) == OWN_HOST
    assert refused_class(ipaddress.ip_address("fe80::1%eth0")) == "link-local address (RFC 4291)"
    # An operator's egress.allow entry still passes it (a link-local address needs its zone to be reached).
    allowed = EgressPolicy("public", ["[fe80::5]:8080"]).for_address("fe80::5%eth0", 8080,
                                                                       ipaddress.ip_address("fe80::5%eth0"))
    assert allowed.allowed and allowed.reason == "egress.allow entry [fe80::5]:8080"
    # Under none, that is the reason.
    assert EgressPolicy("none").for_address("x", 443, ipaddress.ip_address("fe80::1%1")).reason.startswith(
        "egress.policy is none")


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

    monkeypatch.setattr(session_module.asyncio, "open_connection", recording)
    return made


@pytest.mark.parametrize("target", ["10.0.0.5:80", "169.254.169.254:80", "127.0.0.1:443", "[::1]:443",
                                    "[::ffff:192.168.0.1]:443", "intranet.test:443", "[::a9fe:a9fe]:80",
                                    "[::7f00:1]:443", "[::ffff:0:7f00:1]:443", "[64:ff9b:1::a00:1]:443",
                                    "[5f00::1]:443", "[3fff::1]:443", "[2606:4700::1111%1]:443", "[::1%lo]:443"])
def test_refusals_answer_403_naming_the_policy_before_any_connect(target: str, no_connects: list[Any]) -> None:
    async def scenario() -> None:
        proxy, _ = make_proxy({"intranet.test": ["10.1.1.1"]})
        session = proxy.session("alice@example.com", "sbx1", lambda: EgressCall("web_fetch", frozenset(), StandIns()))
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
        answer = await exchange(proxy.session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns())),
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
        session = proxy.session("a@b.c", "s", lambda: EgressCall("t", frozenset(), StandIns()))
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
        refused = await exchange(make_proxy()[0].session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns())),
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
    (b"\x16\x03\x01 garbage\r\n\r\n", b"Invalid method encountered (llhttp, strict)"),
    (b"CONNECT x.test:443 HTTP/1.1\r\n folded\r\n\r\n", b"Unexpected space after start line (llhttp, strict)"),
    (b"CONNECT x.test:443 HTTP/1.1\r\n" + b"X: " + b"a" * 20000 + b"\r\n\r\n", b"exceeds"),
])
def test_malformed_requests_get_400_naming_the_problem(request_bytes: bytes, problem: bytes) -> None:
    async def scenario() -> bytes:
        proxy, looked_up = make_proxy()
        answer = await exchange(proxy.session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns())), request_bytes)
        assert looked_up == []
        return answer

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 400 Bad Request") and problem in answer, answer


def test_an_unknown_name_and_a_refused_port_fail_with_502_and_a_reason() -> None:
    async def scenario() -> None:
        proxy, _ = make_proxy()
        session = proxy.session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns()))
        answer = await exchange(session, b"CONNECT nowhere.test:443 HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 502") and b"X-Sandboxd-Egress: failed" in answer
        assert b"egress to nowhere.test:443 failed: the name does not resolve" in answer
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # nothing listens there now
        allowed, _ = make_proxy(allow=[f"127.0.0.1:{port}"])
        answer = await exchange(allowed.session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns())),
                                f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 502") and b"failed: connection refused" in answer, answer

    asyncio.run(scenario())


def test_a_sandbox_holds_at_most_max_connections_and_close_ends_them() -> None:
    async def scenario() -> None:
        proxy, _ = make_proxy(max_connections=2)
        session = proxy.session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns()))
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


@pytest.mark.parametrize("refusal_cost, served", [(1.0, (25, 45)), (5.0, (4, 12))])
def test_refused_connections_spend_refusal_cost_of_the_connect_rate(tmp_path: Any, refusal_cost: float,
                                                                    served: tuple[int, int]) -> None:
    """A sandbox whose every connection is refused, connecting as fast as it can for 1 s at a
    connect_rate of 20: at refusal_cost 1 it is answered ~40 times (a second's worth at once, then
    20 a second), at 5 a fifth of that; the rest wait in the listener's backlog, unaccepted."""
    async def scenario() -> int:
        proxy, _ = make_proxy(connect_rate=20, refusal_cost=refusal_cost)
        session = proxy.session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns()))
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(tmp_path / "egress.sock"))
        listener.listen(256)
        listener.setblocking(False)
        serving = asyncio.ensure_future(session.serve(listener, lambda peer: True))
        answered = 0

        async def flood() -> None:
            nonlocal answered
            while True:
                reader, writer = await asyncio.open_unix_connection(str(tmp_path / "egress.sock"))
                writer.write(b"CONNECT 10.0.0.5:443 HTTP/1.1\r\n\r\n")
                answer = await reader.read()
                assert answer.startswith(b"HTTP/1.1 403"), answer
                answered += 1
                writer.close()

        floods = [asyncio.ensure_future(flood()) for _ in range(4)]
        await asyncio.sleep(1.0)
        for task in [*floods, serving]:
            task.cancel()
        await asyncio.gather(*floods, serving, return_exceptions=True)
        listener.close()
        return answered

    low, high = served
    answered = asyncio.run(scenario())
    assert low <= answered <= high, answered


def test_the_log_names_user_tool_and_decision_and_masks_secrets() -> None:
    import io

    from sandboxd.logging import configure_logging

    stream = io.StringIO()  # stays open for whatever logs after this test
    configure_logging("info", "json", stream=stream)
    token = "tok-9f8e7d6c5b4a"

    async def scenario() -> None:
        proxy, _ = make_proxy()
        session = proxy.session("alice@example.com", "sbx1", lambda: EgressCall("web_fetch", frozenset({token}), StandIns()))
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
        answer = await exchange(proxy.session("a@b.c", "s", lambda: EgressCall(None, frozenset(), StandIns())),
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
    from sandboxd.server.calls.params import _check_env

    with pytest.raises(InvalidParams, match=f"{name} is set by sandboxd and cannot be overridden"):
        _check_env({name: "x"}, [name])
    assert _check_env({"PI_SEARXNG_URL": "http://127.0.0.1:8888"}, ["PI_SEARXNG_URL"])


def _no_call() -> EgressCall:
    return EgressCall(None, frozenset(), StandIns())


def test_one_users_sandboxes_hold_at_most_two_lookups_even_after_they_time_out(no_connects: list[Any]) -> None:
    """A slow name's lookup keeps its thread after the request gave up: it still counts, and the
    bound is the user's, all their sandboxes together, so one user's slow names leave the other
    DNS threads to everyone else."""

    async def scenario() -> None:
        release = asyncio.Event()
        running: list[str] = []

        async def slow(host: str, port: int) -> list[Any]:
            running.append(host)
            await release.wait()
            return [ipaddress.ip_address("10.0.0.5")]  # refused by class: nothing is connected to

        proxy = EgressProxy(EgressConfig(connect_timeout_ms=200), resolve=slow)
        hostile = [proxy.session("a@b.c", f"s{i}", _no_call) for i in range(4)]
        answers = await asyncio.gather(*(exchange(hostile[i % 4], f"CONNECT slow{i}.test:443 HTTP/1.1\r\n\r\n".encode())
                                         for i in range(6)))
        assert all(a.startswith(b"HTTP/1.1 504") for a in answers), answers  # all gave up after 200 ms
        assert len(running) == 2, running  # four sandboxes, one user: two lookups, the rest never got one
        late = await exchange(proxy.session("a@b.c", "s5", _no_call), b"CONNECT slow9.test:443 HTTP/1.1\r\n\r\n")
        assert late.startswith(b"HTTP/1.1 504") and len(running) == 2  # still held: their threads run on
        other = asyncio.ensure_future(exchange(proxy.session("b@b.c", "s9", _no_call),
                                               b"CONNECT other.test:443 HTTP/1.1\r\n\r\n"))
        await asyncio.sleep(0.05)
        assert "other.test" in running  # another user looks up at once
        release.set()
        assert b"private address" in await other

    asyncio.run(scenario())
    assert no_connects == []


def test_a_lookup_waits_for_a_thread_within_its_deadline_and_never_runs_after_it(no_connects: list[Any]) -> None:
    """Four users holding every thread: a fifth user's lookup waits in the loop, not in the executor's
    queue, so at its deadline it is gone (504) instead of taking a thread later for nobody."""

    async def scenario() -> None:
        release = asyncio.Event()
        running: list[str] = []

        async def slow(host: str, port: int) -> list[Any]:
            running.append(host)
            await release.wait()
            return [ipaddress.ip_address("10.0.0.5")]

        proxy = EgressProxy(EgressConfig(connect_timeout_ms=200), resolve=slow)
        holders = [exchange(proxy.session(f"u{i}@b.c", "s", _no_call), f"CONNECT u{i}-{j}.test:443 HTTP/1.1\r\n\r\n".encode())
                   for i in range(4) for j in range(2)]
        fifth = exchange(proxy.session("e@b.c", "s", _no_call), b"CONNECT late.test:443 HTTP/1.1\r\n\r\n")
        answers = await asyncio.gather(*holders, fifth)
        assert all(a.startswith(b"HTTP/1.1 504") for a in answers), answers
        assert len(running) == 8 and "late.test" not in running, running
        release.set()
        await asyncio.sleep(0.05)
        again = await exchange(proxy.session("e@b.c", "s", _no_call), b"CONNECT again.test:443 HTTP/1.1\r\n\r\n")
        assert b"private address" in again and "late.test" not in running, (again, running)

    asyncio.run(scenario())
    assert no_connects == []
