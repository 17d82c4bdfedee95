"""Noisy neighbours: what many busy users do to a bystander, beside the same figures on the same
daemon while it is quiet, in one run (docs/performance.md, "Noisy neighbours").

One daemon of its own, with the pool's limits set explicitly (max_per_user 4, max_total 32, so
the reserve is 4) and the egress proxy allowed to reach a local source (bench/source.py):

- pool: eight users each keeping six 60-s calls going (32 slots, 28 of them theirs), then four
  newcomers' first calls, timed;
- egress: eight sandboxes downloading from the source as fast as the policy lets them;
- flood: four sandboxes opening refused CONNECTs in 24 loops each (refused by the policy
  before any connect: the destination is a private address);
- stalled: two users' eight sandboxes each holding every tunnel they may (32) to an upstream
  that never reads (bench/stalling.py), writing into each and never reading: every tunnel
  stalled both ways, measured once nothing moves any more;
- dns: on a daemon of its own in a loopback-only namespace whose resolver never answers
  (bench/dead_resolver.py), one user's four sandboxes asking for names in 4 loops each; the
  bystander's lookups of a name in that namespace's /etc/hosts are timed besides.

For each, the bystander (a user with a warm sandbox of their own) pings and calls one after
another; the daemon's CPU and the log's growth are read over the same window. The same pings
go to a yardstick (bench/yardstick.py) as well: what the machine's scheduler alone adds to a
bare server's answer under that crowd, the part of the bystander's latency that is not the
daemon's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

from bench import daemon as d
from bench.dead_resolver import DeadResolver, loopback_only_prefix
from bench.load import daemon_call_line, process_cpu
from bench.source import Source
from bench.stalling import Stalling
from bench.stats import summarize
from bench.wire import LineSocket
from bench.yardstick import Yardstick

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "tests" / "e2e" / "tools" / "egress_probe"  # its pump and flood modes
STALLER = REPO / "tests" / "e2e" / "hostile" / "tunnel_staller"
PINGS, CALLS = 2000, 1000
SCENARIO_S = 10.0
HOSTS_NAME = "bystander.test"  # in the dns daemon's /etc/hosts only: a private address, refused once resolved
LOOKUPS, LOOKUPS_S = 200, 30.0  # the bystander's timed lookups, and the most time they may take (each 504 is 10 s)


def config(image: str, source_port: int, stalling_port: int) -> str:
    return (f"pool:\n  max_per_user: 4\n  max_total: 32\n  acquire_timeout_ms: 120000\n"
            f"egress:\n  allow: ['127.0.0.1:{source_port}', '127.0.0.1:{stalling_port}']\n"
            f"sandbox:\n  image: {image}\n")


class _Background:
    """Calls in threads, one connection each; ``close`` disconnects them (which cancels them)."""

    def __init__(self, daemon: d.BenchDaemon) -> None:
        self._daemon = daemon
        self._conns: list[LineSocket] = []
        self.answers: list[tuple[float, bytes]] = []  # (seconds, reply line) in the order they came

    def call(self, user: str, name: str, arguments: dict[str, Any], timeout_ms: int = 120_000) -> None:
        conn = LineSocket(str(self._daemon.socket), timeout=None)
        self._conns.append(conn)
        params = {"user": user, "name": name, "arguments": arguments, "timeoutMs": timeout_ms}
        line = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": params}).encode() + b"\n"

        def run() -> None:
            started = time.perf_counter()
            try:
                conn.send(line)
                reply = conn.read_line()
            except OSError:
                return
            self.answers.append((time.perf_counter() - started, reply))

        threading.Thread(target=run, daemon=True).start()

    def close(self) -> None:
        for conn in self._conns:
            conn.close()


def _bystander(daemon: d.BenchDaemon, user: str, yardstick: Yardstick) -> dict[str, Any]:
    """What the daemon spends, and how fast its log grows, with only the neighbours running (or
    nothing, quiet); then the bystander's pings and warm calls one after another, and the same
    pings to the yardstick."""
    log0, wall0, cpu0 = daemon.log_path.stat().st_size, time.monotonic(), process_cpu(daemon.pid)
    time.sleep(3.0)
    wall = time.monotonic() - wall0
    alone, log_kib_per_s = (process_cpu(daemon.pid) - cpu0) / wall, (daemon.log_path.stat().st_size - log0) / 1024 / wall
    conn = daemon.connect()
    try:
        ping = d.sequential_calls(conn, b'{"jsonrpc":"2.0","id":%d,"method":"ping"}\n', PINGS)
        cpu0 = process_cpu(daemon.pid)
        calls = d.sequential_calls(conn, daemon_call_line(user), CALLS, first_id=10_000)
        call_cpu_us = 1e6 * (process_cpu(daemon.pid) - cpu0) / CALLS
    finally:
        conn.close()
    conn = LineSocket(yardstick.path)
    try:
        bare = d.sequential_calls(conn, b'{"jsonrpc":"2.0","id":%d,"method":"ping"}\n', PINGS)
    finally:
        conn.close()
    return {"ping": summarize(ping), "yardstick_ping": summarize(bare), "call": {**summarize(calls), "daemon_cpu_us_per_call": call_cpu_us},
            "daemon_cores": alone, "log_kib_per_s": log_kib_per_s}


def _wait(daemon: d.BenchDaemon, predicate: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate(daemon.status()["pool"]):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not happen within {timeout:g} s: {daemon.status()['pool']['totals']}")


def _held(pool: dict[str, Any], users: list[str], state: str = "busy") -> int:
    return sum(pool["users"].get(u, {}).get(state, 0) for u in users)


def pool_at_its_limit(daemon: d.BenchDaemon, run_id: str, bystander: str, yardstick: Yardstick) -> dict[str, Any]:
    heavy = [f"heavy{i}-{run_id}@bench.example" for i in range(8)]
    background = _Background(daemon)
    try:
        for user in heavy:
            for _ in range(6):
                background.call(user, "sleeper", {"ms": 60_000})
        _wait(daemon, lambda p: _held(p, heavy) >= 27 and p["totals"]["starting"] == 0, 120, "eight users filling the pool")
        newcomers = _Background(daemon)
        for i in range(4):
            newcomers.call(f"new{i}-{run_id}@bench.example", "hello", {"name": "newcomer"})
        deadline = time.monotonic() + 30
        while len(newcomers.answers) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        newcomers.close()
        first_calls = [seconds for seconds, line in newcomers.answers if b'"status":"ok"' in line]
        out = _bystander(daemon, bystander, yardstick)
        pool = daemon.status()["pool"]
        out |= {"newcomer_first_call_s": sorted(round(s, 2) for s in first_calls), "newcomers_served": len(first_calls),
                "heavy_holding": _held(pool, heavy, "holding"), "killed": pool["counters"]["killed"]}
        return out
    finally:
        background.close()


def egress_pumping(daemon: d.BenchDaemon, run_id: str, bystander: str, source: Source,
                   yardstick: Yardstick) -> dict[str, Any]:
    pumpers = [f"pump{i}-{run_id}@bench.example" for i in range(8)]
    background = _Background(daemon)
    try:
        for user in pumpers:
            background.call(user, "egress_probe", {"mode": "pump", "url": source.url, "seconds": 60})
        _wait(daemon, lambda p: _held(p, pumpers) == 8, 60, "eight downloads starting")
        time.sleep(2)  # past each sandbox's first second's burst
        sent0, at0 = source.sent, time.monotonic()
        out = _bystander(daemon, bystander, yardstick)
        out["egress_mib_s"] = (source.sent - sent0) / (1 << 20) / (time.monotonic() - at0)
        return out
    finally:
        background.close()


def refused_flood(daemon: d.BenchDaemon, run_id: str, bystander: str, yardstick: Yardstick) -> dict[str, Any]:
    flooders = [f"flood{i}-{run_id}@bench.example" for i in range(4)]
    background = _Background(daemon)
    try:
        for user in flooders:  # a warm sandbox each first, so the flood starts at once
            background.call(user, "egress_probe", {"mode": "routes"})
        _wait(daemon, lambda p: _held(p, flooders, "idle") >= 4, 60, "four sandboxes warm")
        for user in flooders:
            background.call(user, "egress_probe", {"mode": "flood", "request": "CONNECT 10.0.0.5:443 HTTP/1.1\r\n\r\n",
                                                   "port": 24, "seconds": 60})
        time.sleep(1)
        return _bystander(daemon, bystander, yardstick)
    finally:
        background.close()


def _pipe_ends(pid: int) -> int:
    ends = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            ends += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("pipe:")
        except OSError:
            pass  # closed meanwhile
    return ends


def _queued_to(port: int) -> int:
    """Bytes the sockets to 127.0.0.1:``port`` hold unacknowledged (ss's Send-Q): the daemon's, to an upstream
    that never reads (bench/stalling.py sets its own buffers small and never reads, so its Send-Q is small)."""
    out = subprocess.run(["ss", "-tnH", "state", "established", f"( dport = :{port} )"], capture_output=True,
                         text=True, check=True).stdout
    return sum(int(line.split()[1]) for line in out.splitlines() if line.strip())


def _until_still(daemon: d.BenchDaemon, timeout: float = 90) -> float:
    """Seconds until the daemon spends under 0.05 core for a second: every stalled tunnel holds what it
    may (each sandbox fills its tunnels at its egress.rate_bytes first)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        cpu0 = process_cpu(daemon.pid)
        time.sleep(1)
        if process_cpu(daemon.pid) - cpu0 < 0.05:
            return time.monotonic() - started
    raise RuntimeError(f"the stalled tunnels still moved bytes after {timeout:g} s")


def stalled_tunnels(daemon: d.BenchDaemon, run_id: str, bystander: str, stalling: Stalling,
                    yardstick: Yardstick) -> dict[str, Any]:
    stallers = [f"stall{i}-{run_id}@bench.example" for i in range(2)]
    background = _Background(daemon)
    rss0, pipes0 = d.process_rss_mb(daemon.pid), _pipe_ends(daemon.pid)
    try:
        for user in stallers:
            for _ in range(4):  # 36 each: its 32 tunnels and 4 refusals
                background.call(user, "tunnel_staller", {"target": f"127.0.0.1:{stalling.port}", "count": 36,
                                                         "seconds": 150}, 200_000)
        _wait(daemon, lambda p: _held(p, stallers) == 8, 120, "eight sandboxes opening tunnels")
        fill_s = _until_still(daemon)
        out = _bystander(daemon, bystander, yardstick)
        return out | {"fill_s": fill_s, "pipe_ends": _pipe_ends(daemon.pid) - pipes0,
                      "rss_growth_mb": d.process_rss_mb(daemon.pid) - rss0,
                      "queued_mib": _queued_to(stalling.port) / (1 << 20)}
    finally:
        background.close()


def _lookups(daemon: d.BenchDaemon, user: str) -> dict[str, Any]:
    """The bystander's warm calls one after another, each one CONNECT to HOSTS_NAME: their times, and
    how many were not the policy's refusal of the name's address (a lookup that timed out, say)."""
    request = {"mode": "raw", "request": f"CONNECT {HOSTS_NAME}:443 HTTP/1.1\r\n\r\n"}
    line, seconds, failed = daemon_call_line(user, "egress_probe", request), [], 0
    conn, deadline = daemon.connect(), time.monotonic() + LOOKUPS_S
    try:
        for i in range(LOOKUPS):
            if time.monotonic() > deadline:
                break
            started = time.perf_counter()
            conn.send(line % i)
            answer = conn.read_line()
            seconds.append(time.perf_counter() - started)
            failed += b"private address (RFC 1918)" not in answer
    finally:
        conn.close()
    return {"lookup": summarize(seconds), "lookups_failed": failed}


def dead_resolver(root: Path, run_id: str, image: str, yardstick: Yardstick) -> dict[str, Any]:
    """One user's four sandboxes keep asking for names a resolver never answers; the bystander beside them."""
    bystander, hostile = f"dns-bystander-{run_id}@bench.example", f"dead-names-{run_id}@bench.example"
    resolver = DeadResolver(root / "resolver", {HOSTS_NAME: "10.0.0.5"})
    # connect_rate: the bystander's requests are refusals (5 each of 50 a second), timed here for their lookups.
    config_yaml = f"pool:\n  max_per_user: 4\n  max_total: 32\negress:\n  connect_rate: 10000\nsandbox:\n  image: {image}\n"
    daemon = d.BenchDaemon(root, config_yaml, fresh_tools=0, command_prefix=loopback_only_prefix(resolver.binds))
    shutil.copytree(PROBE, daemon.data / "tools" / PROBE.name)
    daemon.start()
    resolver.start(daemon.pid)
    background, out = _Background(daemon), {}
    try:
        conn = daemon.connect()
        d.sequential_calls(conn, daemon_call_line(bystander), 500)  # its sandbox warm, hello loaded
        conn.close()
        _lookups(daemon, bystander)  # egress_probe loaded
        out["dns_quiet"] = _bystander(daemon, bystander, yardstick) | _lookups(daemon, bystander)
        for i in range(4):
            request = f"CONNECT x{i}.dead.test:443 HTTP/1.1\r\n\r\n"
            background.call(hostile, "egress_probe", {"mode": "flood", "request": request, "port": 4, "seconds": 600}, 600_000)
        _wait(daemon, lambda p: _held(p, [hostile]) == 4, 120, "four sandboxes of one user asking for dead names")
        time.sleep(1)  # every loop's request sent and waiting
        out["dns"] = _bystander(daemon, bystander, yardstick) | _lookups(daemon, bystander)
        out["dns"]["resolver_lookups_at_once"] = resolver.most_in_flight()
        return out
    finally:
        resolver.stop()  # its SERVFAILs end the lookups it held
        background.close()
        daemon.stop(timeout=120)


def noisy_neighbours(root: Path, run_id: str, image: str) -> dict[str, Any]:
    bystander = f"bystander-{run_id}@bench.example"
    with Source() as source, Stalling() as stalling, Yardstick() as yardstick:
        daemon = d.BenchDaemon(root, config(image, source.port, stalling.port), fresh_tools=0)
        shutil.copytree(PROBE, daemon.data / "tools" / PROBE.name)
        shutil.copytree(STALLER, daemon.data / "tools" / STALLER.name)
        shutil.copytree(REPO / "tests" / "e2e" / "tools" / "sleeper", daemon.data / "tools" / "sleeper")
        daemon.start()
        out: dict[str, Any] = {"pings": PINGS, "calls": CALLS}
        try:
            conn = daemon.connect()
            d.sequential_calls(conn, daemon_call_line(bystander), 500)  # its sandbox warm, hello loaded
            conn.close()
            for name, scenario in (("pool", lambda: pool_at_its_limit(daemon, run_id, bystander, yardstick)),
                                   ("egress", lambda: egress_pumping(daemon, run_id, bystander, source, yardstick)),
                                   ("flood", lambda: refused_flood(daemon, run_id, bystander, yardstick)),
                                   ("stalled", lambda: stalled_tunnels(daemon, run_id, bystander, stalling, yardstick))):
                daemon.settle(timeout=120)
                out[f"{name}_quiet"] = _bystander(daemon, bystander, yardstick)
                out[name] = scenario()
        finally:
            daemon.stop(timeout=120)
        out |= dead_resolver(root / "dns", run_id, image, yardstick)
    return out
