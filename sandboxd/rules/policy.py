"""Which destinations a sandbox may reach: the decision, without any I/O.

The proxy (egress/proxy.py) asks twice: ``before_resolving`` with the name the tool
asked for (the policy ``none``, a port not allowed, a name an allow-list never
names: refused without a DNS query), then ``for_address`` with each address the name
resolved to. The proxy connects to an address this module allowed and to no other,
so a name that resolves to a public address once and a private one later (DNS
rebinding) gets nowhere. Which addresses are public is rules/addresses.py's to say.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Iterable, Literal

from sandboxd.rules.addresses import SCOPED, IPAddress, IPNetwork, refused_class

PolicyName = Literal["public", "allow-list", "none"]

_HOST_NAME = re.compile(r"^([a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\.)*[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")


def is_host_name(host: str) -> bool:
    """A DNS name in lower case (letters, digits, ``-``, ``_``; labels of 1-63, 253 in all)."""
    return len(host) <= 253 and _HOST_NAME.match(host) is not None


@dataclass(frozen=True)
class AllowEntry:
    """One ``egress.allow`` item: a host name (``*.`` for its subdomains) or a network, with an optional port."""

    text: str
    host: str | None = None  # lower case, no trailing dot
    network: IPNetwork | None = None
    port: int | None = None  # None: the ports in egress.ports

    @classmethod
    def parse(cls, text: str) -> AllowEntry:
        """ValueError naming the problem for anything that is not ``host[:port]``, ``CIDR[:port]`` or ``[v6][:port]``."""
        raw = text.strip()
        if not raw:
            raise ValueError("an empty egress.allow entry; write host[:port] or a CIDR such as 10.1.2.0/24")
        rest, port = raw, None
        if rest.startswith("["):  # [v6 address or network]:port
            end = rest.find("]")
            if end < 0:
                raise ValueError(f"egress.allow entry {text!r} opens [ without closing it")
            rest, tail = rest[1:end], rest[end + 1:]
            if tail:
                if not tail.startswith(":"):
                    raise ValueError(f"egress.allow entry {text!r}: after ] comes :port or nothing")
                port = _port(tail[1:], text)
        elif rest.count(":") == 1:  # host:port or v4[/len]:port (a bare IPv6 address has several)
            rest, port_text = rest.split(":")
            port = _port(port_text, text)
        try:
            network = ipaddress.ip_network(rest, strict=False)
        except ValueError:
            pass
        else:
            return cls(text=raw, network=network, port=port)
        host = rest.lower().rstrip(".")
        if not is_host_name(host.removeprefix("*.")):
            raise ValueError(f"egress.allow entry {text!r} is not a host name, an IP address or a CIDR network "
                             "(e.g. searxng.internal:8080, 10.1.2.0/24, [fd00::5]:8080, *.example.com)")
        return cls(text=raw, host=host, port=port)

    def matches_name(self, host: str) -> bool:
        if self.host is None:
            return False
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and host != self.host[2:]
        return host == self.host

    def allows_port(self, port: int, ports: frozenset[int]) -> bool:
        return port == self.port if self.port is not None else port in ports


def _port(text: str, entry: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"egress.allow entry {entry!r}: {text!r} is not a port (1-65535)")
    return int(text)


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str  # a few words: why allowed ("public address", "egress.allow entry X") or why refused


class EgressPolicy:
    """``egress.policy`` with its ``egress.allow`` entries and ``egress.ports``."""

    def __init__(self, policy: PolicyName, allow: Iterable[str] = (), ports: Iterable[int] = (80, 443),
                 host_addresses: frozenset[IPAddress] = frozenset()) -> None:
        self.policy = policy
        self.allow = tuple(AllowEntry.parse(item) for item in allow)
        self.ports = frozenset(ports)
        self.host_addresses = host_addresses

    def before_resolving(self, host: str, port: int, literal: IPAddress | None) -> Verdict | None:
        """A refusal that needs no address, or None (then resolve and ask ``for_address``).

        ``host`` is lower case without a trailing dot; ``literal`` is set when it is an IP address.
        """
        if self.policy == "none":
            return Verdict(False, "egress.policy is none: sandboxes reach no network")
        if literal is not None:
            return None
        named = [entry for entry in self.allow if entry.matches_name(host)]
        if any(entry.allows_port(port, self.ports) for entry in named):
            return None
        if self.policy == "allow-list" and not any(entry.network is not None for entry in self.allow):
            # Only names are listed, and not this one: no DNS query on its behalf (a tool could
            # otherwise carry data out in the names it asks for).
            return Verdict(False, "not in egress.allow")
        if not named and port not in self.ports and not any(entry.port == port for entry in self.allow):
            return Verdict(False, f"port {port} is not in egress.ports ({_ports(self.ports)})")
        return None

    def for_address(self, host: str, port: int, address: IPAddress) -> Verdict:
        """May a connection to ``address``:``port`` go ahead, for a request that named ``host``?"""
        if self.policy == "none":
            return Verdict(False, "egress.policy is none: sandboxes reach no network")
        for entry in self.allow:
            if not entry.allows_port(port, self.ports):
                continue
            if entry.matches_name(host) or (entry.network is not None and address in entry.network):
                return Verdict(True, f"egress.allow entry {entry.text}")
        if self.policy == "allow-list":
            return Verdict(False, "not in egress.allow")
        if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
            # Refused, not stripped: a scope (zone) id picks the link for a link-local or
            # multicast address, neither of which is public, and the kernel ignores it on any
            # other. A tool has no use for one but to make an address compare unequal to
            # itself (the host-address check once fell for that), so none is guessed at.
            return Verdict(False, SCOPED)
        why = refused_class(address, self.host_addresses)  # the more basic reason goes first
        if why is not None:
            return Verdict(False, why)
        if port not in self.ports:
            return Verdict(False, f"port {port} is not in egress.ports ({_ports(self.ports)})")
        return Verdict(True, "public address")


def _ports(ports: frozenset[int]) -> str:
    return ", ".join(str(p) for p in sorted(ports)) or "none"


def parse_address(host: str) -> IPAddress | None:
    """``host`` as an IP address (IPv6 without brackets), or None for a name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def host_addresses() -> frozenset[IPAddress]:
    """The addresses of this host's own interfaces (Linux /proc; empty elsewhere).

    A sandbox must not reach services on the daemon's host through its public address
    either; loopback and private addresses are refused by class anyway.
    """
    found: set[IPAddress] = set()
    try:
        with open("/proc/net/fib_trie", encoding="ascii") as trie:
            last = None
            for line in trie:
                text = line.strip()
                if text.startswith(("|--", "+--")):
                    last = text[3:].strip().split("/")[0]
                elif "/32 host LOCAL" in text and last:
                    address = parse_address(last)
                    if address is not None:
                        found.add(address)
    except OSError:
        pass
    try:
        with open("/proc/net/if_inet6", encoding="ascii") as inet6:
            for line in inet6:
                hexa = line.split()[0] if line.split() else ""
                if len(hexa) == 32:
                    found.add(ipaddress.IPv6Address(int(hexa, 16)))
    except (OSError, ValueError):
        pass
    return frozenset(found)
