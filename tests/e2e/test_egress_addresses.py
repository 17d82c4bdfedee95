"""Every address form the egress policy refuses, sent by a hostile tool from a real sandbox.

The daemon runs in a network namespace of its own with nothing but a loopback device
(make_daemon(loopback_only=True)), and the netguard refuses any non-loopback connect in
its process: a form the policy wrongly judged public fails to connect (a 502 "failed",
and the test goes red) instead of a packet leaving the machine. Nothing here is sent to a
non-loopback address to "check": the refusal is the policy's, before any connect.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.e2e.conftest import Daemon

pytestmark = pytest.mark.docker

USER = "forms@example.com"
RFC1918 = "private address (RFC 1918)"
LOOPBACK4 = "loopback address (RFC 1122)"
METADATA = "the cloud metadata endpoint"

# (authority as the tool writes it, the reason the refusal names)
FORMS = [
    # IPv4-compatible (::/96) forms of the metadata endpoint and loopback
    ("[::a9fe:a9fe]:80", f"{METADATA}, inside an IPv4-compatible address (169.254.169.254)"),
    ("[::7f00:1]:443", f"{LOOPBACK4}, inside an IPv4-compatible address (127.0.0.1)"),
    # IPv4-mapped and IPv4-translated
    ("[::ffff:169.254.169.254]:80", f"{METADATA}, inside an IPv4-mapped address (169.254.169.254)"),
    ("[::ffff:0:7f00:1]:443", f"{LOOPBACK4}, inside an IPv4-translated address (127.0.0.1)"),
    # NAT64: the well-known prefix, and the local-use one (its /96 and /64 readings)
    ("[64:ff9b::a9fe:a9fe]:80", f"{METADATA}, inside a NAT64 address (169.254.169.254)"),
    ("[64:ff9b:1::a00:1]:443", f"{RFC1918}, inside a local-use NAT64 address (10.0.0.1)"),
    ("[64:ff9b:1:0:a:0:100:0]:443", f"{RFC1918}, inside a local-use NAT64 address (10.0.0.1 read as /64)"),
    # 6to4, and Teredo's client (inverted) and server
    ("[2002:a9fe:a9fe::1]:80", f"{METADATA}, inside a 6to4 address (169.254.169.254)"),
    ("[2001:0:808:808::f5ff:fffe]:443", f"{RFC1918}, inside a Teredo address (client 10.0.0.1)"),
    ("[2001:0:7f00:1::f7f7:f7f7]:443", f"{LOOPBACK4}, inside a Teredo address (server 127.0.0.1)"),
    # IPv6 ranges Python 3.11 calls global, and others of the registry
    ("[5f00::1]:443", "special-purpose address (SRv6 SIDs, RFC 9602)"),
    ("[3fff::1]:443", "documentation address (RFC 9637)"),
    ("[2001:1::1]:443", "special-purpose address (PCP anycast, RFC 7723)"),
    ("[fd00:ec2::254]:80", METADATA),
    ("[4000::1]:443", "not a global unicast address (outside 2000::/3, RFC 4291)"),
    # IPv4's registry
    ("0.0.0.0:443", "unspecified address (RFC 1122)"),
    ("100.64.0.1:443", "shared address space (RFC 6598, carrier-grade NAT)"),
    ("192.0.0.192:80", "special-purpose address (IETF protocol assignments, RFC 6890)"),
    ("198.18.0.1:443", "benchmarking address (RFC 2544)"),
    ("203.0.113.5:443", "documentation address (RFC 5737)"),
    ("240.0.0.1:443", "reserved address (RFC 1112)"),
    # A scoped literal, even of a public address (the host-address check once compared scope ids)
    ("[2606:4700::1111%1]:443", "scoped address (RFC 4007)"),
    ("[::1%lo]:443", "scoped address (RFC 4007)"),
]


def probe(daemon: Daemon, request: str) -> str:
    with daemon.client() as client:
        result = client.call_tool(USER, "egress_probe", {"mode": "raw", "request": request}, timeout_ms=60_000)
    assert result["status"] == "ok", result
    answer: str = json.loads(result["content"][0]["text"])["answer"]
    return answer


def test_the_daemon_under_test_has_nothing_but_loopback(make_daemon: Any) -> None:
    """What the other test relies on, and that sandboxes still run from such a daemon."""
    daemon = make_daemon(loopback_only=True)
    assert daemon.network_namespace() != os.readlink("/proc/self/ns/net")
    assert daemon.network_interfaces() == {"lo"}
    answer = probe(daemon, "CONNECT 10.0.0.5:80 HTTP/1.1\r\n\r\n")  # a sandbox ran a tool and reached the proxy
    assert f"refused by sandboxd's egress policy: {RFC1918};" in answer, answer


def test_every_form_of_a_non_public_address_is_refused_by_the_policy(make_daemon: Any) -> None:
    daemon = make_daemon(loopback_only=True)
    assert daemon.network_interfaces() == {"lo"}
    for authority, reason in FORMS:
        answer = probe(daemon, f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n")
        head, _, body = answer.partition("\r\n\r\n")
        assert head.startswith("HTTP/1.1 403 Forbidden") and "X-Sandboxd-Egress: refused" in head, (authority, answer)
        host, port = authority.rsplit(":", 1)
        assert body.startswith(f"egress to {host.strip('[]')}:{port} refused by sandboxd's egress policy: "
                               f"{reason}; "), (authority, body)
    # The absolute form too, with the scope URL-encoded as RFC 6874 writes it.
    answer = probe(daemon, "GET http://[::7f00:1%25lo]/ HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.startswith("HTTP/1.1 403") and "policy: scoped address (RFC 4007);" in answer, answer
    decisions = daemon.events("egress", user=USER)
    assert [e["decision"] for e in decisions] == ["refused"] * (len(FORMS) + 1), decisions
    assert [e["reason"] for e in decisions[:-1]] == [reason for _, reason in FORMS]
