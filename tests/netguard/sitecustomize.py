"""Loaded by every daemon the e2e harness starts (PYTHONPATH): the daemon's process may open
TCP/UDP connections to loopback only (through socket.connect or uvloop's own), and resolves
no names but /etc/hosts'.

The tests point the egress proxy at private and metadata addresses to see them refused.
Should the policy ever let one through, this turns the connect into an error here (the test
then sees a failure, not a refusal, and goes red) instead of a packet leaving the machine.
A name the hosts file does not hold would be a DNS query to the machine's resolver: it
fails here as not found instead.

Names ending in SLOW_SUFFIX take NETGUARD_SLOW_LOOKUP_S seconds and are then not found: a
hostile tool asks for them to hold the proxy's lookups. The most of them in flight at once
is written to NETGUARD_LOOKUP_LOG.

Names ending in DEAD_SUFFIX go to the machine's real resolver, but only from a network namespace
with nothing but loopback (make_daemon(loopback_only=True)): there a test points the daemon's
/etc/resolv.conf at a nameserver of its own that never answers (bench/dead_resolver.py), and no
query can leave the namespace.
"""

import ipaddress
import os
import socket
import threading
import time

_connect = socket.socket.connect
_connect_ex = socket.socket.connect_ex


def _check(sock: socket.socket, address: object) -> None:
    if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
        _loopback_only(address[0])


def _loopback_only(host: object) -> None:
    text = str(host).split("%")[0]
    try:
        loopback = ipaddress.ip_address(text).is_loopback
    except ValueError:
        loopback = False  # a name: the daemon never connects to names
    if not loopback:
        raise PermissionError(13, f"the test harness allows loopback connections only, not {text}")


def connect(self: socket.socket, address: object) -> None:
    _check(self, address)
    return _connect(self, address)


def connect_ex(self: socket.socket, address: object) -> int:
    _check(self, address)
    return _connect_ex(self, address)


socket.socket.connect = connect  # type: ignore[method-assign]
socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]


def _guard_uvloop() -> None:
    """uvloop (the daemon's loop by default) connects in libuv, never through socket.connect:
    its two ways to open a TCP connection get the same check."""
    try:
        import uvloop
    except ImportError:
        return
    create_connection, sock_connect = uvloop.Loop.create_connection, uvloop.Loop.sock_connect

    async def guarded_create_connection(self, factory, host=None, port=None, **kwargs):  # type: ignore[no-untyped-def]
        if host is not None:  # None: sock=, a socket already connected (a unix one, say)
            _loopback_only(host)
        return await create_connection(self, factory, host, port, **kwargs)

    async def guarded_sock_connect(self, sock, address):  # type: ignore[no-untyped-def]
        _check(sock, address)
        return await sock_connect(self, sock, address)

    uvloop.Loop.create_connection = guarded_create_connection  # type: ignore[method-assign]
    uvloop.Loop.sock_connect = guarded_sock_connect  # type: ignore[method-assign]


_guard_uvloop()


SLOW_SUFFIX = ".slow.test"
DEAD_SUFFIX = ".dead.test"
_getaddrinfo = socket.getaddrinfo
_lock = threading.Lock()
_in_flight = _most_in_flight = 0
_hosts_names: set[str] | None = None


def _hosts() -> set[str]:
    global _hosts_names
    if _hosts_names is None:
        names = set()
        try:
            with open("/etc/hosts") as f:
                for line in f:
                    names.update(name.lower() for name in line.split("#")[0].split()[1:])
        except OSError:
            names.add("localhost")
        _hosts_names = names
    return _hosts_names


def _only_loopback() -> bool:
    """This process's network namespace has no device but lo: no packet can leave it."""
    try:
        with open("/proc/self/net/dev") as f:
            devices = {line.split(":")[0].strip() for line in f.read().splitlines()[2:]}
    except OSError:
        return False
    return devices == {"lo"}


def _slow_lookup(name: str) -> None:
    global _in_flight, _most_in_flight
    with _lock:
        _in_flight += 1
        _most_in_flight = max(_most_in_flight, _in_flight)
        log = os.environ.get("NETGUARD_LOOKUP_LOG")
        if log:
            with open(log, "w") as f:
                f.write(str(_most_in_flight))
    try:
        time.sleep(float(os.environ.get("NETGUARD_SLOW_LOOKUP_S", "1")))
    finally:
        with _lock:
            _in_flight -= 1
    raise socket.gaierror(socket.EAI_NONAME, f"{name}: a slow test name, never found")


def getaddrinfo(host: object, *args: object, **kwargs: object) -> object:
    name = host.decode() if isinstance(host, bytes) else host
    if isinstance(name, str):
        try:
            ipaddress.ip_address(name.split("%")[0])
        except ValueError:
            if name.lower().endswith(SLOW_SUFFIX):
                _slow_lookup(name)
            if name.lower().endswith(DEAD_SUFFIX) and _only_loopback():
                return _getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]
            if name.lower().rstrip(".") not in _hosts():
                raise socket.gaierror(socket.EAI_NONAME, f"the test harness resolves no names but /etc/hosts' ({name})")
    return _getaddrinfo(host, *args, **kwargs)  # type: ignore[arg-type]


socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]
