"""HOST:PORT, one parser for metrics.listen and ``sandboxd mcp --http``: what it reads and how it says no."""

from __future__ import annotations

import ipaddress

import pytest

from sandboxd.hostport import parse_host_port
from sandboxd.config import load_config
from sandboxd.errors import ConfigError
from sandboxd.mcp.http import parse_address

EXAMPLE = "127.0.0.1:80"


@pytest.mark.parametrize(("value", "host", "port"), [
    ("127.0.0.1:8765", "127.0.0.1", 8765),
    ("localhost:1", "127.0.0.1", 1),
    ("[::1]:9000", "::1", 9000),
    ("[fe80::1]:65535", "fe80::1", 65535),
    ("10.1.2.3:443", "10.1.2.3", 443),
    ("::1:80", "::1", 80),  # unbracketed IPv6: the last colon is the port's, as before
])
def test_host_port_is_read(value: str, host: str, port: int) -> None:
    assert parse_host_port(value, example=EXAMPLE) == (ipaddress.ip_address(host), port)


@pytest.mark.parametrize(("value", "says"), [
    ("8765", "is not HOST:PORT; e.g. 127.0.0.1:80"),
    (":8765", "is not HOST:PORT"),
    ("127.0.0.1", "is not HOST:PORT"),
    ("[::1]", "'[::1]' has no port; e.g. 127.0.0.1:80"),
    ("[::1]:", "'' is not a port"),
    ("127.0.0.1:", "'' is not a port (1-65535)"),
    ("127.0.0.1:0", "'0' is not a port (1-65535)"),
    ("127.0.0.1:65536", "is not a port"),
    ("127.0.0.1:-1", "is not a port"),
    ("127.0.0.1:http", "'http' is not a port"),
    ("127.0.0.1:²", "'²' is not a port"),  # a digit to str.isdigit, not to int()
    ("127.0.0.1: 80", "is not a port"),
    ("example.com:80", "'example.com' is not an IP address (names are not resolved); e.g. 127.0.0.1:80"),
    ("[::1:80", "is not an IP address"),
    ("300.1.1.1:80", "is not an IP address"),
])
def test_what_is_not_host_port_is_refused_naming_the_fix(value: str, says: str) -> None:
    with pytest.raises(ValueError) as refused:
        parse_host_port(value, example=EXAMPLE)
    assert str(refused.value).startswith(repr(value)) and says in str(refused.value)


def test_port_zero_is_a_callers_choice() -> None:
    assert parse_host_port("127.0.0.1:0", example=EXAMPLE, lowest_port=0) == (ipaddress.ip_address("127.0.0.1"), 0)
    with pytest.raises(ValueError, match=r"is not a port \(0-65535\)"):
        parse_host_port("127.0.0.1:65536", example=EXAMPLE, lowest_port=0)


def test_both_listeners_use_it() -> None:
    """The metrics address takes port 0 (any free port) and a socket path; --http takes neither, as before."""
    assert load_config(environ={"SANDBOXD_METRICS_LISTEN": "[::1]:0"}).metrics.listen == "[::1]:0"
    with pytest.raises(ConfigError, match=r"metrics.listen.*'\[::1\]' has no port; e.g. '127.0.0.1:9464'"):
        load_config(environ={"SANDBOXD_METRICS_LISTEN": "[::1]"})
    assert parse_address("[::1]:8765") == ("::1", 8765)
    with pytest.raises(ConfigError, match=r"^--http '127.0.0.1:0': '0' is not a port \(1-65535\)$"):
        parse_address("127.0.0.1:0")
    with pytest.raises(ConfigError, match=r"^--http '\[::1\]' has no port; e.g. --http 127.0.0.1:8765$"):
        parse_address("[::1]")
