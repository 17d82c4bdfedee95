"""web_fetch and web_search in real sandboxes, through sandboxd's egress proxy (issue 13).

The sandbox has no network of its own: every request leaves through the daemon's proxy,
which lets a loopback address through only when egress.allow names it. The servers are
this test's own, on 127.0.0.1 (tests/web_site.py); nothing leaves the machine.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sandboxd.client import Client

from tests.web_site import RESULTS, Site, endless, page, redirect, searxng, serve, stall
from tests.e2e.results import ok, refused, text

pytestmark = pytest.mark.docker

A = "alice@example.com"
POLICY = "refused by sandboxd's egress policy"


def allowing(*sites: Site) -> str:
    entries = ", ".join(f'"127.0.0.1:{s.server.server_address[1]}"' for s in sites)
    return f"egress:\n  allow: [{entries}]\n"


def call(client: Client, name: str, arguments: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"user": A, "name": name, "arguments": arguments}
    if env is not None:
        params["env"] = env
    result = client.request("tools/call", params)
    assert result["status"] in ("ok", "error"), result  # the tool answered (no crash, no timeout)
    return result


def test_web_fetch_reaches_a_server_egress_allow_names(make_daemon: Any) -> None:
    with serve() as site, serve() as other:
        site.routes["/article"] = page(b"<title>Local news</title><script>secret()</script>"
                                       b"<p>Hello from <a href='/more'>the host</a>.</p>")
        site.routes["/old"] = redirect(302, "/article")
        site.routes["/away"] = redirect(302, other.base + "/article")  # to a port egress.allow does not name
        other.routes["/article"] = page(b"<p>must not be reached</p>")
        daemon = make_daemon(allowing(site))
        with daemon.client() as client:
            got = ok(call(client, "web_fetch", {"url": site.base + "/old"}))
            assert got.startswith(f"Title: Local news\nURL: {site.base}/article\nRedirected from: {site.base}/old\n"), got
            assert f"Hello from the host [{site.base}/more]." in got and "secret" not in got

            saved = ok(call(client, "web_fetch", {"url": site.base + "/article", "output_path": "news.txt"}))
            line = f"Hello from the host [{site.base}/more]."
            assert f"Saved {len(line)} characters (1 lines) of text to /officer/user/news.txt." in saved, saved
            assert "Hello from the host" in (daemon.user_dir(A) / "news.txt").read_text()
            refused(call(client, "web_fetch", {"url": site.base + "/article", "output_path": "/officer/tools/x.txt"}),
                    "output_path must be inside /officer/user")

            # The redirect's second hop is checked by the proxy again: refused, never fetched.
            refused(call(client, "web_fetch", {"url": site.base + "/away"}),
                    f"Could not fetch {site.base}/away: egress to 127.0.0.1:{other.server.server_address[1]} {POLICY}: ")
        assert other.requests == []
        assert site.requests == ["/old", "/article", "/article", "/away"]


def test_web_fetch_without_egress_allow_gets_the_policy_refusal(make_daemon: Any) -> None:
    with serve() as site:
        site.routes["/"] = page(b"<p>private</p>")
        daemon = make_daemon()  # default policy: public addresses only; the host's loopback is refused
        with daemon.client() as client:
            message = refused(call(client, "web_fetch", {"url": site.base + "/", "timeout_seconds": 120}), "egress.allow")
            # The proxy's own line (the egress contract), not "fetch failed" or a timeout.
            port = site.server.server_address[1]
            assert message.startswith(f"Could not fetch {site.base}/: egress to 127.0.0.1:{port} {POLICY}: "), message
        assert site.requests == []


def test_web_fetch_stops_reading_an_endless_response_in_a_small_sandbox(make_daemon: Any) -> None:
    # Read whole, an endless body takes the 256 MiB sandbox down (or runs to the timeout).
    with serve() as site:
        site.routes["/endless"] = endless
        daemon = make_daemon(allowing(site) + "sandbox:\n  memory: 256m\n")
        with daemon.client() as client:
            got = ok(call(client, "web_fetch", {"url": site.base + "/endless", "timeout_seconds": 120}))
            assert "[web_fetch stopped reading after 5.0 MiB" in got and "all work and no play" in got, got[:500]


def test_a_cancelled_web_fetch_lets_go_of_a_stalling_server_within_the_grace(make_daemon: Any) -> None:
    # A tool that ignores its AbortSignal is killed after calls.cancel_grace_ms, and says so.
    with serve() as site:
        arrived, hung_up = threading.Event(), threading.Event()
        site.routes["/stall"] = stall(arrived, hung_up)
        daemon = make_daemon(allowing(site) + "calls:\n  cancel_grace_ms: 5000\n")
        with daemon.client() as client:
            client.send({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
                "user": A, "name": "web_fetch", "arguments": {"url": site.base + "/stall", "timeout_seconds": 300}}})
            assert arrived.wait(60), "the page was never asked for"
            client.cancel(1, "user pressed stop")
            while "id" not in (reply := client.read_message()):
                pass  # progress
            result = reply["result"]
            assert result["status"] == "cancelled" and "killed" not in text(result), result
            assert hung_up.wait(10), "the sandbox kept the connection to the page open"


def test_web_search_asks_a_searxng_compatible_endpoint(make_daemon: Any) -> None:
    with serve() as searx:
        seen: list[dict[str, list[str]]] = []
        searx.routes["/search"] = searxng(RESULTS, seen)
        daemon = make_daemon(allowing(searx))
        with daemon.client() as client:
            refused(call(client, "web_search", {"query": "sandbox egress"}), "PI_SEARXNG_URL is not set", "pi-bridge")
            got = ok(call(client, "web_search", {"query": "sandbox egress", "max_results": 2},
                          env={"PI_SEARXNG_URL": searx.base}))
            assert got.startswith('2 results for "sandbox egress":\n\n1. First result (2026-03-04)\n'
                                  "   https://one.example/a\n   About sandboxes and egress.\n\n2. "), got
            assert "Third" not in got
        assert seen == [{"q": ["sandbox egress"], "format": ["json"]}]


def test_web_search_to_a_searxng_egress_allow_does_not_name_is_refused_readably(make_daemon: Any) -> None:
    with serve() as searx:
        searx.routes["/search"] = searxng(RESULTS, [])
        daemon = make_daemon()
        with daemon.client() as client:
            refused(call(client, "web_search", {"query": "q"}, env={"PI_SEARXNG_URL": searx.base}),
                    f"Could not reach SearXNG at {searx.base}", POLICY, "egress.allow")
        assert searx.requests == []
