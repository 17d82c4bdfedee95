"""Loaded by every daemon the e2e harness starts (PYTHONPATH): the daemon's process may open
TCP/UDP connections to loopback only.

The tests point the egress proxy at private and metadata addresses to see them refused.
Should the policy ever let one through, this turns the connect into an error here (the test
then sees a failure, not a refusal, and goes red) instead of a packet leaving the machine.
"""

import ipaddress
import socket

_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex


def _check(sock: socket.socket, address: object) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
        host = str(address[0]).split("%")[0]
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False  # a name: the daemon never connects to names
        if not loopback:
            raise PermissionError(13, f"the test harness allows loopback connections only, not {host}")


def connect(self: socket.socket, address: object) -> None:
    _check(self, address)
    return _connect(self, address)


def connect_ex(self: socket.socket, address: object) -> int:
    _check(self, address)
    return _connect_ex(self, address)


socket.socket.connect = connect  # type: ignore[method-assign]
socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]
