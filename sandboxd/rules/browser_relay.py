"""The browser relay: the one place on the host (or beyond) a tool reaches at 127.0.0.1 inside its sandbox.

The platform's browser tools connect to ``127.0.0.1:$OFFICER_BROWSER_RELAY_PORT``. In a sandbox
(network none) that is the sandbox's own loopback, and the egress policy refuses the host's. So
the operator names where the relay listens, ``integrations.browser_relay: HOST:PORT`` or
``HOST:FIRST-LAST``. For a call whose env names a port inside it, the daemon tells the shim so
(``browserRelay`` in the call, docs/shim.md); the shim listens on 127.0.0.1 and ::1 at that port
for the call and sends each connection on the sandbox's egress socket as ``CONNECT
browser-relay.sandboxd.invalid:PORT``. The proxy (egress/proxy.py) connects that to HOST:PORT, and
only for the port of the call running in that sandbox: the host is the operator's, never the
sandbox's to name, and the tunnel is held to the sandbox's egress budgets like any other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from sandboxd.rules.policy import Verdict, is_host_name, parse_address

# What the shim asks the proxy for: under .invalid (RFC 6761), a name that never resolves, so it
# can never be a real destination that this one shadows.
RELAY_NAME = "browser-relay.sandboxd.invalid"
PORT_ENV = "OFFICER_BROWSER_RELAY_PORT"
SETTING = "integrations.browser_relay"
EXAMPLE = "e.g. '127.0.0.1:9222' or '127.0.0.1:9222-9230'"
ALLOWED = Verdict(True, SETTING)

# [IPv6] or a host without colons, then a port or a range.
_RELAY = re.compile(r"^(?:\[([^\]]*)\]|([^:\[\]]*)):(\d{1,5})(?:-(\d{1,5}))?$")


@dataclass(frozen=True)
class BrowserRelay:
    """``integrations.browser_relay``: a host (name or address) and the ports it listens on."""

    text: str
    host: str  # lower case, IPv6 without brackets
    first: int
    last: int

    @classmethod
    def parse(cls, text: str) -> BrowserRelay:
        """ValueError naming the problem and the form for anything but ``HOST:PORT`` or ``HOST:FIRST-LAST``."""
        where = repr(text)
        match = _RELAY.match(text.strip())
        if match is None:
            if "://" in text:
                raise ValueError(f"{where} is a URL; write where the relay listens as HOST:PORT, "
                                 f"{EXAMPLE.removeprefix('e.g. ')}")
            if text.count(":") > 1 and "[" not in text:
                raise ValueError(f"{where}: write an IPv6 address in brackets, e.g. '[::1]:9222'")
            raise ValueError(f"{where} is not HOST:PORT or HOST:FIRST-LAST; {EXAMPLE}")
        bracketed, name, first_text, last_text = match.groups()
        if bracketed is not None and parse_address(bracketed) is None:
            raise ValueError(f"{where}: [{bracketed}] is not an IPv6 address; {EXAMPLE}")
        host = bracketed if bracketed is not None else name.lower().rstrip(".")
        if parse_address(host) is None and not is_host_name(host):
            raise ValueError(f"{where}: {host!r} is not a host name or an IP address; {EXAMPLE}")
        first = int(first_text)
        last = int(last_text) if last_text is not None else first
        for port in (first, last):
            if not 0 < port < 65536:
                raise ValueError(f"{where}: {port} is not a port (1-65535)")
        if first > last:
            raise ValueError(f"{where}: the range {first}-{last} is empty; write the lower port first")
        return cls(text=text.strip(), host=host, first=first, last=last)

    def covers(self, port: int) -> bool:
        return self.first <= port <= self.last


@dataclass(frozen=True)
class RelayForCall:
    """What the shim is told about a call whose env names ``OFFICER_BROWSER_RELAY_PORT``:
    the port to listen on, or why nothing listens (it then says so to a tool that connects)."""

    port: int | None
    error: str | None = None

    @property
    def granted(self) -> int | None:
        """The port the call may reach the relay on, or None."""
        return self.port if self.error is None else None

    def to_param(self) -> dict[str, Any]:
        return {"port": self.port} if self.error is None else {"port": self.port, "error": self.error}


def relay_for_call(relay: BrowserRelay | None, env: Mapping[str, str]) -> RelayForCall | None:
    """None when the call's env names no relay port; else the port granted, or the reason it is not."""
    value = env.get(PORT_ENV)
    if value is None:
        return None
    text = str(value).strip()
    port = int(text) if text.isdigit() and 0 < int(text) < 65536 else None
    if port is None:
        return RelayForCall(None, f"{PORT_ENV} {str(value)[:20]!r} is not a port (1-65535)")
    lead = f"the browser relay is not reached on port {port}"
    if relay is None:
        return RelayForCall(port, f"{lead}: this sandboxd has no browser relay ({SETTING} is not set; the operator "
                                  "sets it to the relay's HOST:PORT)")
    if not relay.covers(port):
        return RelayForCall(port, f"{lead}: the port is outside {SETTING} ({relay.text}), the ports the operator "
                                  f"named for the relay; the operator can widen the range")
    return RelayForCall(port)


def tunnel_verdict(relay: BrowserRelay | None, port: int, call_port: int | None) -> Verdict:
    """May a sandbox whose running call was granted ``call_port`` open a tunnel to the relay's ``port``?"""
    if relay is None:
        return Verdict(False, f"{SETTING} is not set")
    if not relay.covers(port):
        return Verdict(False, f"port {port} is outside {SETTING} ({relay.text})")
    if call_port is None:
        return Verdict(False, f"no call running with {PORT_ENV} inside {SETTING}")
    if port != call_port:
        return Verdict(False, f"port {port} is not the running call's {PORT_ENV} ({call_port})")
    return ALLOWED


def relay_refusal_message(port: int, verdict: Verdict) -> str:
    return (f"the browser relay on port {port} refused by sandboxd: {verdict.reason}; a tool reaches the relay at "
            f"127.0.0.1:${PORT_ENV} during a call whose env sets it, on a port of {SETTING}")
