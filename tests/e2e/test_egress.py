"""The network boundary, end to end: a real daemon, real sandboxes, a server on 127.0.0.1.

Sandboxes have no route of their own; the egress proxy is their only way out. Nothing
here leaves the machine: every destination is an IP literal or `localhost`, the only
server reached is one this test starts on 127.0.0.1, and private addresses (10.0.0.5)
are refused by the policy before any connect. The raw-socket tests speak the proxy's
protocol directly; the fetch/http/python tests go through what the shim installs.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
from typing import Any, Iterator

import pytest

from tests.e2e.conftest import GVISOR, Daemon

pytestmark = pytest.mark.docker

USER = "egress@example.com"
PRIVATE = "10.0.0.5"  # refused by class: never connected to


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
        self.server.paths.append(self.path)
        if self.path.startswith("/redirect-private"):
            self.send_response(302)
            self.send_header("Location", f"http://{PRIVATE}/internal")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = b"x" * int(self.path.split("/")[-1]) if self.path.startswith("/bytes/") else b"hello through the proxy"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    paths: list[str]
    connections: int

    def get_request(self) -> Any:
        self.connections += 1
        return super().get_request()


@pytest.fixture
def web() -> Iterator[_Server]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.paths, server.connections = [], 0
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def probe(daemon: Daemon, mode: str, **arguments: Any) -> dict[str, Any]:
    with daemon.client() as client:
        result = client.call_tool(USER, "egress_probe", {"mode": mode, **arguments}, timeout_ms=60_000)
    assert result["status"] == "ok", result
    return json.loads(result["content"][0]["text"])


def allowing(make_daemon: Any, web: _Server, **env: str) -> Daemon:
    port = web.server_address[1]
    return make_daemon(env={"SANDBOXD_EGRESS_ALLOW": f'["127.0.0.1:{port}"]', **env})


# --- no route of its own --------------------------------------------------------------------

def test_a_sandbox_has_no_route_and_no_interface_but_loopback(make_daemon: Any) -> None:
    seen = probe(make_daemon(), "routes")
    interfaces = {line.split(":")[0].strip() for line in seen["dev"].splitlines()[2:]}
    assert interfaces == {"lo"}, seen["dev"]
    assert seen["route"].splitlines()[1:] == [], seen["route"]  # IPv4: not even a link route
    for line in seen["ipv6_route"].splitlines():  # IPv6: loopback's own entries, no usable default
        fields = line.split()
        assert fields[-1] == "lo", line
        if fields[0] == "0" * 32 and fields[1] == "00":  # ::/0 exists only as the kernel's reject entry
            assert int(fields[8], 16) & 0x0200, f"a default route that is not RTF_REJECT: {line}"


@pytest.mark.parametrize("host", ["192.0.2.1", "2001:db8::1"])  # documentation ranges: nothing there anyway
def test_a_direct_connect_fails_at_once_with_no_route(make_daemon: Any, host: str) -> None:
    seen = probe(make_daemon(), "direct", host=host, port=80)
    # gVisor's network stack, with no interface but loopback, says EHOSTUNREACH: no route either way.
    assert seen.get("code") == ("EHOSTUNREACH" if GVISOR else "ENETUNREACH") and seen["ms"] < 5_000, seen


# --- the proxy, spoken directly -------------------------------------------------------------

def test_the_hosts_loopback_is_refused_by_default(make_daemon: Any, web: _Server) -> None:
    port = web.server_address[1]
    daemon = make_daemon()
    seen = probe(daemon, "raw", request=f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n")
    head, _, body = seen["answer"].partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 403") and "X-Sandboxd-Egress: refused" in head, seen
    assert body.strip() == (f"egress to 127.0.0.1:{port} refused by sandboxd's egress policy: "
                            "loopback address (RFC 1122); the operator can allow it with egress.allow")
    assert web.connections == 0
    event = daemon.events("egress", decision="refused")[-1]
    assert event["user"] == USER and event["tool"] == "egress_probe" and event["port"] == port
    assert event["reason"] == "loopback address (RFC 1122)"


def test_private_and_metadata_addresses_are_refused_before_any_connect(make_daemon: Any) -> None:
    daemon = make_daemon(loopback_only=True)  # a wrong decision cannot leave; test_egress_addresses.py: every form
    for target, reason in ((f"{PRIVATE}:80", "private address (RFC 1918)"),
                           ("169.254.169.254:80", "the cloud metadata endpoint"),
                           ("[fd00::1]:443", "unique local address (RFC 4193)")):
        seen = probe(daemon, "raw", request=f"CONNECT {target} HTTP/1.1\r\n\r\n")
        assert f"refused by sandboxd's egress policy: {reason}" in seen["answer"], seen
    assert {e["reason"] for e in daemon.events("egress", decision="refused")} >= {
        "private address (RFC 1918)", "the cloud metadata endpoint", "unique local address (RFC 4193)"}


def test_a_listed_local_server_is_reached_through_the_socket(make_daemon: Any, web: _Server) -> None:
    port = web.server_address[1]
    seen = probe(allowing(make_daemon, web), "raw",
                 request=f"GET http://127.0.0.1:{port}/page HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n")
    assert seen["answer"].startswith("HTTP/1.0 200") and seen["answer"].endswith("hello through the proxy"), seen
    assert web.paths == ["/page"]


def test_policy_none_refuses_even_what_egress_allow_names(make_daemon: Any, web: _Server) -> None:
    port = web.server_address[1]
    daemon = allowing(make_daemon, web, SANDBOXD_EGRESS_POLICY="none")
    seen = probe(daemon, "raw", request=f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n")
    assert "egress.policy is none" in seen["answer"] and web.connections == 0, seen


# --- through what the shim installs: tools need no change -----------------------------------

def test_fetch_http_and_a_python_child_reach_a_listed_server(make_daemon: Any, web: _Server) -> None:
    port = web.server_address[1]
    daemon = allowing(make_daemon, web)
    url = f"http://127.0.0.1:{port}/page"
    assert probe(daemon, "fetch", url=url) == {"status": 200, "body": "hello through the proxy", "url": url}
    assert probe(daemon, "http", url=url) == {"status": 200, "body": "hello through the proxy"}
    child = probe(daemon, "python", url=url)
    assert child["stdout"] == "hello through the proxy", child
    assert web.paths == ["/page"] * 3
    assert len(daemon.events("egress", decision="allowed", user=USER, tool="egress_probe")) == 3


def test_a_refusal_reaches_the_tool_as_the_policys_reason_on_every_path(make_daemon: Any, web: _Server) -> None:
    port = web.server_address[1]
    daemon = make_daemon()
    url = f"http://127.0.0.1:{port}/page"
    reason = f"egress to 127.0.0.1:{port} refused by sandboxd's egress policy: loopback address (RFC 1122)"
    fetched = probe(daemon, "fetch", url=url)
    assert reason in fetched["error"], fetched  # "fetch failed: egress to ...", not a bare "fetch failed"
    assert reason in probe(daemon, "http", url=url)["error"]
    child = probe(daemon, "python", url=url)
    assert "403" in child["stdout"], child  # urllib's HTTPError: Forbidden, the proxy's answer
    assert web.connections == 0


def test_a_name_resolving_to_loopback_is_refused(make_daemon: Any, web: _Server) -> None:
    """`localhost` resolves from the host's /etc/hosts, so no DNS query leaves the machine. The
    port is opened (egress.ports), so that the address is what refuses it, after resolution."""
    port = web.server_address[1]
    daemon = make_daemon(env={"SANDBOXD_EGRESS_PORTS": f"[80, 443, {port}]"})
    fetched = probe(daemon, "fetch", url=f"http://localhost:{port}/page")
    assert (f"egress to localhost:{port} refused by sandboxd's egress policy: loopback address (RFC 1122)"
            in fetched["error"]), fetched
    assert web.connections == 0


def test_a_redirect_to_a_private_address_is_refused_at_its_hop(make_daemon: Any, web: _Server) -> None:
    port = web.server_address[1]
    daemon = allowing(make_daemon, web)
    fetched = probe(daemon, "fetch", url=f"http://127.0.0.1:{port}/redirect-private")
    assert (f"egress to {PRIVATE}:80 refused by sandboxd's egress policy: private address (RFC 1918)"
            in fetched["error"]), fetched
    assert web.paths == ["/redirect-private"]  # the first hop was served, the second never connected
    refused = daemon.events("egress", decision="refused", host=PRIVATE)
    assert refused and refused[-1]["port"] == 80


# --- the proxy's own limits, against a hostile tool and a hostile client ---------------------

def test_a_tool_holding_egress_connections_gets_503_past_the_cap(make_daemon: Any) -> None:
    daemon = make_daemon(env={"SANDBOXD_EGRESS_MAX_CONNECTIONS": "4"}, loopback_only=True)
    seen = probe(daemon, "hold", port=4, request=f"CONNECT {PRIVATE}:80 HTTP/1.1\r\n\r\n")
    assert seen["answer"].startswith("HTTP/1.1 503"), seen
    assert "already holds 4 egress connections (egress.max_connections)" in seen["answer"], seen
    # Once they are closed, the sandbox gets its answers again.
    assert "refused by sandboxd's egress policy" in probe(daemon, "raw", request=f"CONNECT {PRIVATE}:80 HTTP/1.1\r\n\r\n")["answer"]


def test_a_tool_asking_for_many_slow_names_holds_two_lookups_at_most(make_daemon: Any, tmp_path: Any) -> None:
    """Six CONNECTs at once to names whose lookup takes a second (the netguard's slow test names,
    never a DNS query): the proxy resolves two of them at a time for one user (LOOKUPS_PER_USER),
    so its resolver threads stay free for the others; each is answered, as not resolving."""
    log = tmp_path / "lookups"
    daemon = make_daemon(env={"NETGUARD_LOOKUP_LOG": str(log), "NETGUARD_SLOW_LOOKUP_S": "1"})
    answers = probe(daemon, "parallel", port=6, request="CONNECT n{i}.slow.test:443 HTTP/1.1\r\n\r\n")
    assert len(answers) == 6 and all(a["answer"].startswith("HTTP/1.1 502") for a in answers), answers
    assert all("the name does not resolve" in a["answer"] for a in answers), answers
    assert log.read_text() == "2", "lookups of one sandbox in flight at once"


def test_a_tool_downloading_as_fast_as_it_can_is_held_to_egress_rate_bytes(make_daemon: Any, web: _Server) -> None:
    """256 KiB at egress.rate_bytes = 64 KiB/s, a second's worth at once: at least 3 s. The
    same download at the default rate is not held (only a lower bound is asserted)."""
    size, rate = 256 << 10, 64 << 10
    url = f"http://127.0.0.1:{web.server_address[1]}/bytes/{size}"
    fast = probe(allowing(make_daemon, web), "download", url=url)
    assert fast["status"] == 200 and fast["bytes"] == size, fast
    slow = probe(allowing(make_daemon, web, SANDBOXD_EGRESS_RATE_BYTES=str(rate)), "download", url=url)
    assert slow["status"] == 200 and slow["bytes"] == size, slow
    assert slow["ms"] >= 1000 * (size - rate) / rate * 0.9, slow  # the bucket held it
    assert slow["ms"] > fast["ms"], (slow, fast)


def test_a_process_outside_the_sandbox_is_not_served_on_its_egress_socket(make_daemon: Any, web: _Server) -> None:
    """The socket's directory is the daemon's (0700), but even root on the host, being another uid
    than the sandbox's, gets no answer: only the sandbox's own processes are served."""
    port = web.server_address[1]
    daemon = allowing(make_daemon, web)
    probe(daemon, "routes")  # a sandbox runs
    shims = daemon.socket.parent / f"{daemon.socket.name}.shims"
    [egress_socket, *_] = sorted(shims.glob("*/egress.sock"))
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(10)
        client.connect(str(egress_socket))
        client.sendall(f"GET http://127.0.0.1:{port}/page HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        try:
            answer = client.recv(100)
        except ConnectionResetError:  # closed over the unread request
            answer = b""
        assert answer == b"", answer  # closed unanswered
    assert web.paths == []
    assert daemon.events("egress_foreign_peer"), "the refusal is logged"
