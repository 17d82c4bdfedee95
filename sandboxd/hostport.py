"""``HOST:PORT``, read one way for every address the daemon listens on (metrics.listen, ``sandboxd mcp --http``).

A leaf: the standard library only, so config and the mcp bridge can both use it.
"""

from __future__ import annotations

import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def parse_host_port(value: str, *, example: str, lowest_port: int = 1) -> tuple[IPAddress, int]:
    """``HOST:PORT`` → (address, port): HOST an IP address, IPv6 in brackets (``[::1]:80``), or ``localhost`` (127.0.0.1).

    Names other than localhost are refused, not resolved. ValueError says what is wrong and ends with
    ``example``; whether the address may be other than loopback is the caller's to say.
    """
    if value.startswith("[") and value.endswith("]"):  # else "[::1]" would read as host "[:" and port "1]"
        raise ValueError(f"{value!r} has no port; e.g. {example}")
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is not HOST:PORT; e.g. {example}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        host = "127.0.0.1"
    # ASCII only: str.isdigit() also passes "²", which int() then refuses with a bare ValueError.
    if not (port_text.isascii() and port_text.isdigit()) or not lowest_port <= int(port_text) <= 65535:
        raise ValueError(f"{value!r}: {port_text!r} is not a port ({lowest_port}-65535)")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r}: {host!r} is not an IP address (names are not resolved); e.g. {example}") from None
    return address, int(port_text)
