"""A warm call through `sandboxd router` beside the same call sent to its host directly, and 100 new users
spread over two hosts started from cold (docs/performance.md).

A test etcd, two hosts with mutual-TLS listeners (certificates made with openssl), one router;
the user's calls alternate in rounds between the router's socket, their home host's socket, and
the home host's TLS listener (with the router's certificate: the hop the router cannot avoid), and
a relay floor, socat passing the bytes to that listener (what any router costs at least, in C),
so all four share the machine's state. The router's CPU per call is its process's, over its rounds.
Before that, while the hosts hold no sandbox, ``SPREAD_USERS`` new users call once each through the router
(``SPREAD_CALLERS`` at a time): the time to the last answer, each first call's latency, and the users per
host their homes in etcd say.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench import daemon as d
from bench.load import daemon_call_line, process_cpu
from bench.stats import summarize
from bench.wire import LineSocket

ROUNDS = 5
SPREAD_USERS = 100
SPREAD_CALLERS = 16  # clients calling at once, each its share of the new users one after another
HOST_POOL = "pool:\n  min_idle: 0\n  max_total: 16\n"  # small: a 2-core machine starts ~100 sandboxes in a minute


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
                                                  base=HOST_POOL, extra=f"sandbox:\n  image: {image}\n")
            hosts[name] = d.BenchDaemon(root / name, config, fresh_tools=0)
            hosts[name].start()
        router.start()
        say(f"{SPREAD_USERS} new users through the router, over two hosts started from cold ({SPREAD_CALLERS} at a time)")
        spread = cold_spread(router.socket, [f"spread-{run_id}-{i}@bench.example" for i in range(SPREAD_USERS)],
                             homes=lambda: _homes(etcd))
        user = f"router-{run_id}@bench.example"
        say(f"a warm call through the router beside its host directly ({calls} calls each, {ROUNDS} rounds)")
        tls = client_context(ClusterTLS(cert=certs.router.cert, key=certs.router.key, ca=certs.router.ca))
        with RelayFloor(root / "relay", addresses, certs.router) as relay:
            return {**_alternate(router, hosts, user, calls, router_pid=router.proc.pid if router.proc else 0,
                                 over_tls=lambda home: TlsLines(addresses[home], tls), relay=relay),
                    "spread": spread}
    finally:
        router.stop()
        for host in hosts.values():
            host.stop()
        etcd.stop()


class RelayFloor:
    """The floor of any router: socat (C, no parsing) relaying a unix connection's bytes to a host's TLS listener
    with the router's certificate. One forked socat per connection, each with its own TLS connection."""

    def __init__(self, folder: Path, addresses: dict[str, str], cert: Any) -> None:
        self.folder, self.addresses, self.cert = folder, addresses, cert
        self.procs: list[subprocess.Popen[bytes]] = []
        self.relay_pid = 0  # the child socat forked for the last connection: its CPU is the relay's

    def __enter__(self) -> RelayFloor:
        return self

    def __exit__(self, *exc: Any) -> None:
        for proc in self.procs:
            os.killpg(proc.pid, signal.SIGKILL)  # the listener and the child it forked for the connection
            proc.wait()

    def connect(self, home: str) -> LineSocket | None:
        """A connection through a relay to ``home``'s listener; None without socat."""
        if shutil.which("socat") is None:
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{home}.sock"
        host, _, port = self.addresses[home].rpartition(":")
        tls = (f"OPENSSL-CONNECT:{host}:{port},cert={self.cert.cert},key={self.cert.key},cafile={self.cert.ca},"
               f"commonname=node:{home},nodelay")
        proc = subprocess.Popen(["socat", f"UNIX-LISTEN:{path},fork", tls], stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + 10
        while not path.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"socat did not listen on {path}")
            time.sleep(0.02)
        conn = LineSocket(str(path))
        conn.request("ping")  # the forked child is up once the host answered through it
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        self.relay_pid = int(children[0]) if children else 0
        return conn


def _alternate(router: Any, hosts: dict[str, d.BenchDaemon], user: str, calls: int, *, router_pid: int,
               over_tls: Callable[[str], LineSocket], relay: RelayFloor) -> dict[str, Any]:
    template = daemon_call_line(user)
    via = LineSocket(str(router.socket))
    try:
        d._check_ok(d._call(via, template, 0)[1], "the first call through the router")  # claims the user a home
        status = via.request("sandbox/status")
        home = next(name for name, host in status["hosts"].items() if user in host["pool"]["users"])
        direct, tls, floor = hosts[home].connect(), over_tls(home), relay.connect(home)
        ways = {"direct": direct, "tls": tls, **({"relay": floor} if floor is not None else {})}
        try:
            chunk = max(1, calls // ROUNDS)
            for conn in (via, *ways.values()):
                d.sequential_calls(conn, template, 200, first_id=1)
            latencies: dict[str, list[float]] = {name: [] for name in (*ways, "router")}
            cpu_s = {"router": 0.0, "relay": 0.0}
            pids = {"router": router_pid, "relay": relay.relay_pid}
            for round_ in range(ROUNDS):
                first = 1000 + round_ * chunk
                for name, conn in {**ways, "router": via}.items():
                    cpu0 = process_cpu(pids[name]) if pids.get(name) else 0.0
                    latencies[name] += d.sequential_calls(conn, template, chunk, first_id=first)
                    if pids.get(name):
                        cpu_s[name] += process_cpu(pids[name]) - cpu0
        finally:
            for conn in ways.values():
                conn.close()
    finally:
        via.close()
    return {**{name: summarize(seconds) for name, seconds in latencies.items()},
            "router_cpu_us_per_call": 1e6 * cpu_s["router"] / len(latencies["router"]),
            **({"relay_cpu_us_per_call": 1e6 * cpu_s["relay"] / len(latencies["relay"])} if floor is not None else {}),
            "home": home}


def cold_spread(router_socket: Path, users: list[str], *, homes: Callable[[], dict[str, str]]) -> dict[str, Any]:
    """Each of ``users`` calls once through the router, ``SPREAD_CALLERS`` clients at a time: the time from the
    first call to the last answer, the calls' latencies, and how many users each host got (their homes)."""
    shares = [users[i::SPREAD_CALLERS] for i in range(SPREAD_CALLERS)]
    latencies: list[float] = []
    failures: list[bytes] = []
    lock = threading.Lock()

    def caller(share: list[str]) -> None:
        conn = LineSocket(str(router_socket))
        try:
            for user in share:
                elapsed, line = d._call(conn, daemon_call_line(user), 1)
                with lock:
                    (latencies.append(elapsed) if b'"status":"ok"' in line else failures.append(line[:400]))
        finally:
            conn.close()

    threads = [threading.Thread(target=caller, args=(share,)) for share in shares]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(users)} first calls through the router failed: {failures[0]!r}")
    per_host: dict[str, int] = {}
    for user, node in homes().items():
        if user in users:
            per_host[node] = per_host.get(node, 0) + 1
    return {"users": len(users), "callers": SPREAD_CALLERS, "last_answer_s": elapsed, "calls": summarize(latencies),
            "per_host": dict(sorted(per_host.items()))}


def _homes(etcd: Any) -> dict[str, str]:
    """user → home host, as the directory in etcd says (keys and values on alternate lines)."""
    lines = etcd.ctl("get", "--prefix", "/sandboxd/users/").stdout.splitlines()
    return {key.rsplit("/", 1)[-1]: json.loads(value).get("node") for key, value in zip(lines[::2], lines[1::2])}
