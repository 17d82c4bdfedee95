"""systemd integration without libsystemd: sd_notify(3) and sd_listen_fds(3).

Both protocols are small and stable: a notification is one datagram of
``KEY=VALUE`` lines sent to the AF_UNIX socket named by ``$NOTIFY_SOCKET``
(a path, or ``@name`` for the abstract namespace); socket activation passes
listening sockets from fd 3 up, with ``LISTEN_FDS`` saying how many and
``LISTEN_PID`` saying for which process. Outside systemd every call here is a
no-op, so the daemon runs the same under a terminal, a container or a unit.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Callable, Mapping, MutableMapping

from sandboxd.errors import ConfigError
from sandboxd.logging import get_logger

log = get_logger("sandboxd.systemd")

SD_LISTEN_FDS_START = 3
# How often STATUS= is refreshed when it changed (and the watchdog fed, if its interval is longer).
STATUS_INTERVAL_S = 5.0
SEND_TIMEOUT_S = 1.0


class Notifier:
    """Sends sd_notify messages to ``$NOTIFY_SOCKET``; does nothing when it is unset."""

    def __init__(self, notify_socket: str | None) -> None:
        self.address: str | None = None
        if notify_socket:
            if notify_socket.startswith("@"):
                self.address = "\0" + notify_socket[1:]  # the abstract namespace
            elif notify_socket.startswith("/"):
                self.address = notify_socket
            else:
                log.warning("notify_socket_unsupported", notify_socket=notify_socket,
                            hint="only filesystem paths and @abstract names are supported; readiness will not be reported")
        self._sock: socket.socket | None = None
        self._failed = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        environ = os.environ if environ is None else environ
        return cls(environ.get("NOTIFY_SOCKET"))

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str) -> bool:
        """One datagram of FIELD=value lines; False if not under systemd or the send failed."""
        if self.address is None:
            return False
        # A value may not span lines: the message format is one assignment per line.
        message = "\n".join(f"{key}={str(value).replace(chr(10), ' ')}" for key, value in fields.items())
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                # A datagram queue that stays full this long means systemd is not reading;
                # the event loop must not wait on it longer than that.
                self._sock.settimeout(SEND_TIMEOUT_S)
            self._sock.sendto(message.encode(), self.address)
        except OSError as exc:
            # Worth one warning (systemd will time the unit out), not one per watchdog ping.
            if not self._failed:
                log.warning("notify_failed", error=str(exc), notify_socket=self.address.replace("\0", "@"))
                self._failed = True
            return False
        self._failed = False
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY="1", STATUS=status)

    def reloading(self) -> bool:
        # systemd (v253+) insists on MONOTONIC_USEC with RELOADING=1, to order it against READY=1.
        return self.send(RELOADING="1", MONOTONIC_USEC=str(time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000))

    def stopping(self, status: str) -> bool:
        return self.send(STOPPING="1", STATUS=status)

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG="1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between watchdog pings (half of WatchdogSec, as sd_watchdog_enabled advises), or None."""
    environ = os.environ if environ is None else environ
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = environ.get("WATCHDOG_PID")
    if pid and pid != str(os.getpid()):
        return None  # meant for another process (we were started by one that was supervised)
    return int(usec) / 2 / 1_000_000


def listen_socket(environ: MutableMapping[str, str] | None = None) -> socket.socket | None:
    """The listening socket systemd passed (sandboxd.socket), or None when not socket-activated.

    Like sd_listen_fds(1), it removes LISTEN_* from the environment so nothing the
    daemon starts believes the socket is meant for it.
    """
    environ = os.environ if environ is None else environ
    pid, count = environ.get("LISTEN_PID"), environ.get("LISTEN_FDS")
    if pid is None or count is None:
        return None
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        environ.pop(name, None)
    if pid != str(os.getpid()):
        return None
    if not count.isdigit():
        raise ConfigError(f"LISTEN_FDS={count!r} is not a number; it is set by systemd's socket activation, not by hand.")
    if int(count) == 0:
        return None
    if int(count) != 1:
        raise ConfigError(
            f"systemd passed {count} sockets (LISTEN_FDS={count}); sandboxd serves exactly one: "
            "give sandboxd.socket a single ListenStream= line."
        )
    try:
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    except OSError as exc:
        raise ConfigError(f"fd {SD_LISTEN_FDS_START} passed by systemd is not a socket ({exc.strerror}).") from None
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        sock.detach()
        raise ConfigError(
            f"the socket systemd passed is {sock.family.name}/{sock.type.name}, not a unix stream socket; "
            "use ListenStream=/run/sandboxd/sandboxd.sock in sandboxd.socket."
        )
    if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
        sock.detach()
        raise ConfigError("the socket systemd passed is not listening; pass a ListenStream= socket (Accept=no).")
    sock.set_inheritable(False)
    sock.setblocking(False)
    return sock


async def supervise(notifier: Notifier, describe: Callable[[], str], watchdog: float | None) -> None:
    """Feed the watchdog and keep STATUS= current, until cancelled.

    Pings come from the event loop itself, so a wedged loop (the thing that
    would stop the daemon answering) is what makes systemd restart it.
    """
    period = min(watchdog, STATUS_INTERVAL_S) if watchdog else STATUS_INTERVAL_S
    last_status = None
    while True:
        fields = {"WATCHDOG": "1"} if watchdog else {}
        status = describe()
        if status != last_status:
            fields["STATUS"] = last_status = status
        if fields:
            notifier.send(**fields)
        await asyncio.sleep(period)
