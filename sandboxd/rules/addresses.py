"""Is an IP address on the public internet? Judged by what it reaches, allow-list style.

IPv4 is public outside every range of IANA's IPv4 special-purpose registry (and multicast).
IPv6 is public only inside global unicast, 2000::/3, outside every range of IANA's IPv6
special-purpose registry. An IPv6 address that carries an IPv4 address (mapped, compatible,
translated, NAT64, 6to4, Teredo) reaches that IPv4 address through the kernel or a gateway,
so it is judged by the IPv4 address it carries. The tables below are the registries as of
2025 (https://www.iana.org/assignments/iana-ipv4-special-registry, iana-ipv6-special-registry),
each range with its RFC; Python's ``is_global`` is not used, its tables lag the registries
(3.11 knows neither 3fff::/20 nor 5f00::/16, and calls ::/96 and 64:ff9b:1::/48 global).

A refusal is a few words naming the class, then the range's source in parentheses, e.g.
``documentation address (RFC 3849)``; the metrics label is the words before " (" or ", ".
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Callable, Union

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

OWN_HOST = "an address of the daemon's own host"
SCOPED = "scoped address (RFC 4007)"
_NOT_GLOBAL_UNICAST = "not a global unicast address (outside 2000::/3, RFC 4291)"
_SPECIAL = "special-purpose address"  # IETF protocol assignments: anycast services, identifiers, sinks

# Every range of IANA's IPv4 special-purpose registry, plus multicast and metadata endpoints.
# Some the registry calls globally reachable (PCP/TURN anycast, AS112, AMT): none is a web
# server a tool needs, so they are refused too; egress.allow opens one if it ever is.
IPV4_SPECIAL: tuple[tuple[str, str, str], ...] = (
    ("0.0.0.0/8", "unspecified address", "RFC 791"),  # "this network"; 0.0.0.0 reaches the host itself
    ("0.0.0.0/32", "unspecified address", "RFC 1122"),
    ("10.0.0.0/8", "private address", "RFC 1918"),
    ("100.64.0.0/10", "shared address space", "RFC 6598, carrier-grade NAT"),
    ("127.0.0.0/8", "loopback address", "RFC 1122"),
    ("169.254.0.0/16", "link-local address", "RFC 3927"),
    ("169.254.169.254/32", "the cloud metadata endpoint", ""),
    ("168.63.129.16/32", "the cloud metadata endpoint", "Azure WireServer"),  # public, but the host's platform
    ("172.16.0.0/12", "private address", "RFC 1918"),
    ("192.0.0.0/24", _SPECIAL, "IETF protocol assignments, RFC 6890"),
    ("192.0.0.0/29", _SPECIAL, "IPv4 service continuity, RFC 7335"),
    ("192.0.0.8/32", _SPECIAL, "IPv4 dummy address, RFC 7600"),
    ("192.0.0.9/32", _SPECIAL, "PCP anycast, RFC 7723"),
    ("192.0.0.10/32", _SPECIAL, "TURN anycast, RFC 8155"),
    ("192.0.0.170/31", _SPECIAL, "NAT64/DNS64 discovery, RFC 8880"),
    ("192.0.2.0/24", "documentation address", "RFC 5737"),
    ("192.31.196.0/24", _SPECIAL, "AS112, RFC 7535"),
    ("192.52.193.0/24", _SPECIAL, "AMT, RFC 7450"),
    ("192.88.99.0/24", _SPECIAL, "6to4 relay anycast, RFC 7526"),
    ("192.88.99.2/32", _SPECIAL, "6a44 relay anycast, RFC 6751"),
    ("192.168.0.0/16", "private address", "RFC 1918"),
    ("192.175.48.0/24", _SPECIAL, "AS112, RFC 7534"),
    ("198.18.0.0/15", "benchmarking address", "RFC 2544"),
    ("198.51.100.0/24", "documentation address", "RFC 5737"),
    ("203.0.113.0/24", "documentation address", "RFC 5737"),
    ("224.0.0.0/4", "multicast address", "RFC 5771"),
    ("240.0.0.0/4", "reserved address", "RFC 1112"),
    ("255.255.255.255/32", "broadcast address", "RFC 919"),
)

# Every range of IANA's IPv6 special-purpose registry but those that carry an IPv4 address
# (IPV6_CARRIERS, below), plus what lies outside 2000::/3 and has a name of its own. As for IPv4,
# the ranges the registry calls globally reachable are refused too (2001:1::1, 2001:3::/32,
# 2001:4:112::/48, 2001:20::/28, 2001:30::/28, 2620:4f:8000::/48: anycast services, AS112
# sinks, AMT relays, cryptographic identifiers).
IPV6_SPECIAL: tuple[tuple[str, str, str], ...] = (
    ("::/128", "unspecified address", "RFC 4291"),
    ("::1/128", "loopback address", "RFC 4291"),
    ("100::/64", _SPECIAL, "discard-only, RFC 6666"),
    ("100:0:0:1::/64", _SPECIAL, "dummy prefix, RFC 9780"),
    ("2001::/23", _SPECIAL, "IETF protocol assignments, RFC 2928"),
    ("2001:1::1/128", _SPECIAL, "PCP anycast, RFC 7723"),
    ("2001:1::2/128", _SPECIAL, "TURN anycast, RFC 8155"),
    ("2001:1::3/128", _SPECIAL, "DNS-SD SRP anycast, RFC 9665"),
    ("2001:2::/48", "benchmarking address", "RFC 5180"),
    ("2001:3::/32", _SPECIAL, "AMT, RFC 7450"),
    ("2001:4:112::/48", _SPECIAL, "AS112, RFC 7535"),
    ("2001:10::/28", _SPECIAL, "ORCHID, RFC 4843"),
    ("2001:20::/28", _SPECIAL, "ORCHIDv2, RFC 7343"),
    ("2001:30::/28", _SPECIAL, "drone remote ID, RFC 9374"),
    ("2001:db8::/32", "documentation address", "RFC 3849"),
    ("2620:4f:8000::/48", _SPECIAL, "AS112, RFC 7534"),
    ("3fff::/20", "documentation address", "RFC 9637"),
    ("5f00::/16", _SPECIAL, "SRv6 SIDs, RFC 9602"),
    ("fc00::/7", "unique local address", "RFC 4193"),
    ("fd00:ec2::254/128", "the cloud metadata endpoint", ""),
    ("fe80::/10", "link-local address", "RFC 4291"),
    ("fec0::/10", "site-local address", "RFC 3879"),
    ("ff00::/8", "multicast address", "RFC 4291"),
)
_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")


Carried = Callable[[ipaddress.IPv6Address], list[tuple[ipaddress.IPv4Address, str]]]  # (IPv4, how to name it)


def _low32(address: ipaddress.IPv6Address) -> list[tuple[ipaddress.IPv4Address, str]]:
    ipv4 = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return [(ipv4, str(ipv4))]


def _local_nat64(address: ipaddress.IPv6Address) -> list[tuple[ipaddress.IPv4Address, str]]:
    """RFC 8215 lets a local translator take any prefix length from /48 to /96 inside
    64:ff9b:1::/48, and RFC 6052 puts the IPv4 address at a different place for each (bits
    64-71 skipped). The daemon cannot know which one the network uses, so every reading
    must be public: the /96 one first, the usual one."""
    value = int(address)
    without_u = (value >> 64 << 56) | (value & ((1 << 56) - 1))  # 120 bits: bits 64-71 dropped
    found = _low32(address)
    for prefix_length in (64, 56, 48):
        ipv4 = ipaddress.IPv4Address((without_u >> (120 - prefix_length - 32)) & 0xFFFFFFFF)
        found.append((ipv4, f"{ipv4} read as /{prefix_length}"))
    return found


def _sixtofour(address: ipaddress.IPv6Address) -> list[tuple[ipaddress.IPv4Address, str]]:
    ipv4 = ipaddress.IPv4Address((int(address) >> 80) & 0xFFFFFFFF)
    return [(ipv4, str(ipv4))]


def _teredo(address: ipaddress.IPv6Address) -> list[tuple[ipaddress.IPv4Address, str]]:
    server = ipaddress.IPv4Address((int(address) >> 64) & 0xFFFFFFFF)
    client = ipaddress.IPv4Address(~int(address) & 0xFFFFFFFF)  # stored inverted (RFC 4380 §4)
    return [(client, f"client {client}"), (server, f"server {server}")]


# IPv6 forms whose packets end up at the IPv4 address inside them: the kernel sends
# IPv4-mapped ones as IPv4, a sit device or a gateway (NAT64/SIIT, 6to4 and Teredo relays)
# the others. Judged by that IPv4 address (both of Teredo's: its client and its server).
IPV6_CARRIERS: tuple[tuple[str, str, Carried], ...] = (
    ("::ffff:0:0/96", "an IPv4-mapped address", _low32),  # RFC 4291
    ("::/96", "an IPv4-compatible address", _low32),  # RFC 4291, deprecated; :: and ::1 are judged as themselves
    ("::ffff:0:0:0/96", "an IPv4-translated address", _low32),  # RFC 2765 (SIIT)
    ("64:ff9b::/96", "a NAT64 address", _low32),  # RFC 6052
    ("64:ff9b:1::/48", "a local-use NAT64 address", _local_nat64),  # RFC 8215
    ("2002::/16", "a 6to4 address", _sixtofour),  # RFC 3056
    ("2001::/32", "a Teredo address", _teredo),  # RFC 4380
)


@dataclass(frozen=True)
class _Range:
    network: IPNetwork
    reason: str = ""  # refused for this reason, or
    form: str = ""  # judged by the IPv4 address(es) ``carried`` finds in it
    carried: Carried | None = None


def _by_specificity(ranges: list[_Range]) -> tuple[_Range, ...]:
    """Longest prefix first, so that the first match is the most specific range (::1 before ::/96)."""
    return tuple(sorted(ranges, key=lambda entry: -entry.network.prefixlen))


def _refused(net: str, words: str, source: str) -> _Range:
    return _Range(ipaddress.ip_network(net), reason=f"{words} ({source})" if source else words)


_V4_TABLE = _by_specificity([_refused(*entry) for entry in IPV4_SPECIAL])
_V6_TABLE = _by_specificity([_refused(*entry) for entry in IPV6_SPECIAL]
                            + [_Range(ipaddress.ip_network(net), form=form, carried=carried)
                               for net, form, carried in IPV6_CARRIERS])


def unscoped(address: IPAddress) -> IPAddress:
    """``address`` without its IPv6 scope id: ``fe80::1%eth0`` and ``fe80::1`` are unequal in
    Python, so sets of addresses must be compared without one."""
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id is not None:
        return ipaddress.IPv6Address(int(address))
    return address


def refused_class(address: IPAddress, host_addresses: frozenset[IPAddress] = frozenset()) -> str | None:
    """Why ``address`` is not on the public internet (a few words), or None if it is.

    A scope id is ignored here (EgressPolicy refuses scoped addresses before asking)."""
    address = unscoped(address)
    why = _class_v4(address) if isinstance(address, ipaddress.IPv4Address) else _class_v6(address, host_addresses)
    if why is None and address in host_addresses:
        return OWN_HOST
    return why


def _class_v4(address: ipaddress.IPv4Address) -> str | None:
    return next((entry.reason for entry in _V4_TABLE if address in entry.network), None)


def _class_v6(address: ipaddress.IPv6Address, host_addresses: frozenset[IPAddress]) -> str | None:
    entry = next((entry for entry in _V6_TABLE if address in entry.network), None)
    if entry is None:
        return None if address in _GLOBAL_UNICAST else _NOT_GLOBAL_UNICAST
    if entry.carried is None:
        return entry.reason
    for ipv4, named in entry.carried(address):
        why = refused_class(ipv4, host_addresses)
        if why is not None:
            return f"{why}, inside {entry.form} ({named})"
    return None
