"""A nameserver that reads every query and never answers, for a daemon in a network namespace
with nothing but loopback: what a hostile tool's names cost the egress proxy's DNS threads.

The daemon runs under ``loopback_only_prefix(resolver.binds)``: a network namespace of its own
(only ``lo``) and a mount namespace in which /etc/resolv.conf names this server and /etc/hosts
holds the test's names. ``start(pid)`` then runs the server in that network namespace, so no
query can leave it. ``stop()`` answers each query it held with SERVFAIL, which ends the
daemon's lookups at once, and stops the server.
Used by tests/e2e/test_egress_dns.py and the noisy-neighbour figures (bench/neighbours.py).
Run as ``python -m bench.dead_resolver ADDRESS REPORT`` it is the server itself.
"""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ADDRESS = "127.0.0.53"
# glibc's longest wait for one server (RES_MAXRETRANS), once: each lookup holds its thread 30 s.
WAIT_S = 30
RESOLV_CONF = f"nameserver {ADDRESS}\noptions timeout:{WAIT_S} attempts:1\n"
SERVFAIL = 0x8182  # a response (QR), recursion desired and available, rcode 2


def loopback_only_prefix(binds: dict[str, Path] | None = None) -> list[str]:
    """The command prefix that runs a daemon in a network namespace with only ``lo`` up, and with
    ``binds`` (a file of the system → the file to see there) in a mount namespace of its own.
    It execs: the daemon keeps the prefix's pid, signals reach it directly."""
    mounts = [arg for target, source in (binds or {}).items() for arg in (str(source), target)]
    script = "ip link set lo up"
    for i in range(0, len(mounts), 2):
        script += f' && mount --bind "${i + 1}" "${i + 2}"'
    script += f' && shift {len(mounts)} && exec "$@"'
    unshare = ["unshare", "--net", "--mount"] if mounts else ["unshare", "--net"]
    return [*unshare, "sh", "-c", script, "sh", *mounts]


class DeadResolver:
    """Its files (resolv.conf, a hosts file with ``hosts``: name → address) are written to ``folder``;
    the server runs from ``start`` to ``stop`` in a daemon's network namespace."""

    def __init__(self, folder: Path, hosts: dict[str, str]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.resolv_conf, self.hosts, self.report = folder / "resolv.conf", folder / "hosts", folder / "queries.json"
        self.resolv_conf.write_text(RESOLV_CONF)
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{address} {name}\n" for name, address in hosts.items()))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def binds(self) -> dict[str, Path]:
        return {"/etc/resolv.conf": self.resolv_conf, "/etc/hosts": self.hosts}

    def start(self, pid: int, timeout: float = 10) -> None:
        """The server, in the network namespace of process ``pid``, listening when this returns."""
        self.report.unlink(missing_ok=True)
        repo = Path(__file__).resolve().parent.parent
        self._proc = subprocess.Popen(["nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, "-m", "bench.dead_resolver",
                                       ADDRESS, str(self.report)], cwd=repo)
        deadline = time.monotonic() + timeout
        while not self.report.exists():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the dead resolver did not start in process {pid}'s network namespace")
            time.sleep(0.02)

    def most_in_flight(self) -> int:
        """The most lookups waiting on it at once so far. Each has a socket, so a source port, of its own,
        and waits WAIT_S from its query (a new one a second before another's end counts both)."""
        return int(json.loads(self.report.read_text())["most_in_flight"])

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            self._proc.wait(10)


def _servfail(query: bytes) -> bytes:
    """The answer that ends a lookup now: the query's id and question, rcode SERVFAIL."""
    return query[:2] + SERVFAIL.to_bytes(2, "big") + query[4:6] + b"\0\0\0\0" + query[10:]


def _write(report: Path, most_in_flight: int, queries: int) -> None:
    """Whole or not at all: the test reads it while the server runs."""
    part = report.with_suffix(".part")
    part.write_text(json.dumps({"most_in_flight": most_in_flight, "queries": queries}))
    part.replace(report)


def _stop_on_sigterm() -> list[bool]:
    stopping = [False]
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__(0, True))
    return stopping


def serve(address: str, report: Path) -> None:
    stopping = _stop_on_sigterm()
    held: list[tuple[bytes, tuple[str, int]]] = []
    last_query: dict[int, float] = {}  # a lookup's source port → when it last asked
    most = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as server:
        server.bind((address, 53))
        _write(report, 0, 0)
        while not stopping[0]:
            if select.select([server], [], [], 0.2)[0]:
                query, peer = server.recvfrom(4096)
                now = time.monotonic()
                held.append((query, peer))
                last_query[peer[1]] = now
                most = max(most, sum(1 for at in last_query.values() if now - at < WAIT_S - 1))
                _write(report, most, len(held))
        for query, peer in held:
            if len(query) >= 12:
                server.sendto(_servfail(query), peer)


if __name__ == "__main__":
    serve(sys.argv[1], Path(sys.argv[2]))
