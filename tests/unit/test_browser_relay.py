"""integrations.browser_relay: the setting, what a call is granted, and the proxy's tunnels to the relay."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sandboxd.config import ConfigError, load_config, needs_restart
from sandboxd.egress.contract import EgressCall
from sandboxd.rules.browser_relay import RELAY_NAME, BrowserRelay, RelayForCall, relay_for_call, tunnel_verdict
from sandboxd.rules.secrets import StandIns
from sandboxd.sandbox.backend import CallRequest
from tests.unit.test_egress import Upstream, exchange, make_proxy

ENV = "SANDBOXD_INTEGRATIONS_BROWSER_RELAY"


# --- the setting ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, host, first, last", [
    ("127.0.0.1:9222", "127.0.0.1", 9222, 9222),
    ("127.0.0.1:9222-9230", "127.0.0.1", 9222, 9230),
    ("[::1]:9222", "::1", 9222, 9222),
    ("Relay.Internal.:9000-9000", "relay.internal", 9000, 9000),
    (" 10.0.5.9:1-65535 ", "10.0.5.9", 1, 65535),
])
def test_the_relay_is_host_and_port_or_range(text: str, host: str, first: int, last: int) -> None:
    relay = load_config(environ={ENV: text}).integrations.relay
    assert relay == BrowserRelay(text=text.strip(), host=host, first=first, last=last)
    assert relay.covers(first) and relay.covers(last) and not relay.covers(first - 1) and not relay.covers(last + 1)


def test_unset_means_no_relay_and_a_reload_applies_it() -> None:
    assert load_config(environ={}).integrations.relay is None
    assert load_config(environ={ENV: ""}).integrations.relay is None  # an empty variable is null
    assert not needs_restart("integrations.browser_relay")


@pytest.mark.parametrize("value, problem", [
    ("9222", "9222 is not HOST:PORT; name the relay's host too, and quote it, e.g. '127.0.0.1:9222'"),
    ("relay", "'relay' is not HOST:PORT or HOST:FIRST-LAST; e.g. '127.0.0.1:9222' or '127.0.0.1:9222-9230'"),
    (":9222", "'' is not a host name or an IP address"),
    ("127.0.0.1:", "{'127.0.0.1': None} is not HOST:PORT or HOST:FIRST-LAST; quote it"),  # YAML's reading
    ("127.0.0.1:0", "0 is not a port (1-65535)"),
    ("127.0.0.1:65536", "65536 is not a port (1-65535)"),
    ("127.0.0.1:9230-9222", "the range 9230-9222 is empty; write the lower port first"),
    ("127.0.0.1:9222-", "'127.0.0.1:9222-' is not HOST:PORT or HOST:FIRST-LAST"),
    ("127.0.0.1:http", "'127.0.0.1:http' is not HOST:PORT or HOST:FIRST-LAST"),
    ("127.0.0.1:123456", "'127.0.0.1:123456' is not HOST:PORT or HOST:FIRST-LAST"),
    ("::1:9222", "write an IPv6 address in brackets, e.g. '[::1]:9222'"),
    ("[relay]:9222", "[relay] is not an IPv6 address"),
    ("relay host:9222", "'relay host' is not a host name or an IP address"),
    ("http://127.0.0.1:9222", "'http://127.0.0.1:9222' is a URL; write where the relay listens as HOST:PORT"),
])
def test_a_bad_value_stops_start_up_naming_the_key_and_the_form(value: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(environ={ENV: value})
    assert "integrations.browser_relay: " in str(caught.value)
    assert problem in str(caught.value), str(caught.value)


def test_the_yaml_file_takes_it_under_integrations(tmp_path: Any) -> None:
    path = tmp_path / "config.yaml"
    path.write_text('integrations:\n  browser_relay: "127.0.0.1:9222-9224"\n')
    assert load_config(path, environ={}).integrations.relay == BrowserRelay("127.0.0.1:9222-9224", "127.0.0.1",
                                                                            9222, 9224)
    path.write_text("integrations:\n  browser: 127.0.0.1:9222\n")
    with pytest.raises(ConfigError, match="integrations.browser: unknown key"):
        load_config(path, environ={})


# --- what a call is granted ------------------------------------------------------------------------

RELAY = BrowserRelay.parse("127.0.0.1:9222-9224")


def test_a_call_is_granted_a_port_inside_the_range_and_told_why_not_otherwise() -> None:
    assert relay_for_call(RELAY, {}) is None
    assert relay_for_call(None, {"PI_SEARXNG_URL": "x"}) is None
    granted = relay_for_call(RELAY, {"OFFICER_BROWSER_RELAY_PORT": "9223"})
    assert granted == RelayForCall(9223) and granted.granted == 9223 and granted.to_param() == {"port": 9223}

    outside = relay_for_call(RELAY, {"OFFICER_BROWSER_RELAY_PORT": "9300"})
    assert outside is not None and outside.granted is None and outside.port == 9300
    assert outside.error == ("the browser relay is not reached on port 9300: the port is outside "
                             "integrations.browser_relay (127.0.0.1:9222-9224), the ports the operator named for "
                             "the relay; the operator can widen the range")
    unset = relay_for_call(None, {"OFFICER_BROWSER_RELAY_PORT": "9223"})
    assert unset is not None and unset.granted is None
    assert "this sandboxd has no browser relay (integrations.browser_relay is not set" in str(unset.error)
    for bad in ("abc", "0", "70000", "-1", ""):
        refused = relay_for_call(RELAY, {"OFFICER_BROWSER_RELAY_PORT": bad})
        assert refused is not None and refused.port is None and "is not a port (1-65535)" in str(refused.error)


def test_the_shim_is_told_only_when_the_env_names_the_port() -> None:
    base = CallRequest(tool_call_id="c", entry="/e", arguments={})
    assert "browserRelay" not in base.to_params()
    told = CallRequest(tool_call_id="c", entry="/e", arguments={}, browser_relay=RelayForCall(9300, "why"))
    assert told.to_params()["browserRelay"] == {"port": 9300, "error": "why"}


@pytest.mark.parametrize("relay, port, call_port, reason", [
    (None, 9222, 9222, "integrations.browser_relay is not set"),
    (RELAY, 9225, 9225, "port 9225 is outside integrations.browser_relay (127.0.0.1:9222-9224)"),
    (RELAY, 9222, None, "no call running with OFFICER_BROWSER_RELAY_PORT inside integrations.browser_relay"),
    (RELAY, 9223, 9222, "port 9223 is not the running call's OFFICER_BROWSER_RELAY_PORT (9222)"),
])
def test_a_tunnel_needs_the_setting_the_range_and_the_running_calls_port(relay: BrowserRelay | None, port: int,
                                                                          call_port: int | None, reason: str) -> None:
    verdict = tunnel_verdict(relay, port, call_port)
    assert not verdict.allowed and verdict.reason == reason
    assert tunnel_verdict(RELAY, 9224, 9224).allowed


# --- the proxy's tunnels to the relay, over real sockets ---------------------------------------------

def test_the_proxy_connects_the_relay_name_to_the_operators_host_only_for_the_granted_port() -> None:
    async def scenario() -> None:
        upstream = await Upstream().start()
        port = upstream.port
        proxy, looked_up = make_proxy({"relay.test": ["127.0.0.1"]}, policy="none")  # the relay is not egress
        proxy.browser_relay = BrowserRelay.parse(f"relay.test:{port}-{port + 1}")
        session = proxy.session("a@b.c", "s", lambda: EgressCall("browser", frozenset(), StandIns(), port))

        answer = await exchange(session, f"CONNECT {RELAY_NAME}:{port} HTTP/1.1\r\n\r\nGET / HTTP/1.0\r\n\r\n".encode())
        assert answer.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.0 200 OK"), answer
        assert answer.endswith(b"hello from upstream") and looked_up == ["relay.test"]

        other = await exchange(session, f"CONNECT {RELAY_NAME}:{port + 1} HTTP/1.1\r\n\r\n".encode())
        assert other.startswith(b"HTTP/1.1 403") and b"X-Sandboxd-Egress: refused" in other, other
        assert f"port {port + 1} is not the running call's OFFICER_BROWSER_RELAY_PORT ({port})".encode() in other
        proxied = await exchange(session, f"GET http://{RELAY_NAME}:{port}/ HTTP/1.1\r\n\r\n".encode())
        assert proxied.startswith(b"HTTP/1.1 400") and b"reached with CONNECT" in proxied, proxied

        proxy.browser_relay = None  # a reload that removes it: the next tunnel is refused
        unset = await exchange(session, f"CONNECT {RELAY_NAME}:{port} HTTP/1.1\r\n\r\n".encode())
        assert unset.startswith(b"HTTP/1.1 403") and b"integrations.browser_relay is not set" in unset, unset
        assert upstream.connections == 1
        assert proxy.decisions == {("allowed", "integrations.browser_relay"): 1, ("refused", "port not allowed"): 1,
                                   ("refused", "integrations.browser_relay is not set"): 1}

    asyncio.run(scenario())
