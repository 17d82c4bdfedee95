"""A warm call through `sandboxd router` beside the same call sent to its host directly (docs/performance.md).

A test etcd, two hosts with mutual-TLS listeners (certificates made with openssl), one router;
the user's calls alternate in rounds between the router's socket, their home host's socket, and
the home host's TLS listener (with the router's certificate: the hop the router cannot avoid),
so all three share the machine's state. The router's CPU per call is its process's, over its rounds.
"""

from __future__ import annotations

import shutil
import socket
import ssl
from pathlib import Path
from typing import Any, Callable

from bench import daemon as d
from bench.load import daemon_call_line, process_cpu
from bench.stats import summarize
from bench.wire import LineSocket

ROUNDS = 5


class TlsLines(LineSocket):
    """A host's cluster listener, dialled with a certificate: the same line reading as on its unix socket."""

    def __init__(self, address: str, context: ssl.SSLContext) -> None:  # noqa: super().__init__ dials a unix socket
        host, _, port = address.rpartition(":")
        self.sock = context.wrap_socket(socket.create_connection((host, int(port)), timeout=120))
        self._buffer = bytearray()
        self._ids = 0


def router_cost(root: Path, run_id: str, image: str, *, calls: int, say: Callable[[str], None]) -> dict[str, Any]:
    if shutil.which("etcd") is None or shutil.which("openssl") is None:
        return {"skipped": "etcd or openssl is missing (scripts/ci-deps.sh installs them)"}
    from sandboxd.cluster.tls import client_context
    from sandboxd.config.cluster import ClusterTLS
    from tests.cluster.certs import make_certs
    from tests.cluster.etcd import Etcd
    from tests.cluster.router import Router, host_config

    etcd = Etcd().start()
    certs = make_certs(root / "certs")
    hosts: dict[str, d.BenchDaemon] = {}
    addresses: dict[str, str] = {}
    router = Router(root, etcd.url, certs.router)
    try:
        for name, cert in (("a", certs.node_a), ("b", certs.node_b)):
            config, addresses[name] = host_config(name, etcd.url, cert, lease_s=5,  # the default: 2 s fenced a busy host
                                                  extra=f"sandbox:\n  image: {image}\n")
            hosts[name] = d.BenchDaemon(root / name, config, fresh_tools=0)
            hosts[name].start()
        router.start()
        user = f"router-{run_id}@bench.example"
        say(f"a warm call through the router beside its host directly ({calls} calls each, {ROUNDS} rounds)")
        tls = client_context(ClusterTLS(cert=certs.router.cert, key=certs.router.key, ca=certs.router.ca))
        return _alternate(router, hosts, user, calls, router_pid=router.proc.pid if router.proc else 0,
                          over_tls=lambda home: TlsLines(addresses[home], tls))
    finally:
        router.stop()
        for host in hosts.values():
            host.stop()
        etcd.stop()


def _alternate(router: Any, hosts: dict[str, d.BenchDaemon], user: str, calls: int, *, router_pid: int,
               over_tls: Callable[[str], LineSocket]) -> dict[str, Any]:
    template = daemon_call_line(user)
    via = LineSocket(str(router.socket))
    try:
        d._check_ok(d._call(via, template, 0)[1], "the first call through the router")  # claims the user a home
        status = via.request("sandbox/status")
        home = next(name for name, host in status["hosts"].items() if user in host["pool"]["users"])
        direct, tls = hosts[home].connect(), over_tls(home)
        try:
            chunk = max(1, calls // ROUNDS)
            for conn in (via, direct, tls):
                d.sequential_calls(conn, template, 200, first_id=1)
            routed: list[float] = []
            straight: list[float] = []
            listener: list[float] = []
            cpu_s = 0.0
            for round_ in range(ROUNDS):
                first = 1000 + round_ * chunk
                straight += d.sequential_calls(direct, template, chunk, first_id=first)
                listener += d.sequential_calls(tls, template, chunk, first_id=first)
                cpu0 = process_cpu(router_pid)
                routed += d.sequential_calls(via, template, chunk, first_id=first)
                cpu_s += process_cpu(router_pid) - cpu0
        finally:
            direct.close()
            tls.close()
    finally:
        via.close()
    return {"direct": summarize(straight), "tls": summarize(listener), "router": summarize(routed),
            "router_cpu_us_per_call": 1e6 * cpu_s / len(routed), "home": home}
