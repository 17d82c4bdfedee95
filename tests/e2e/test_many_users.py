"""Many ordinary users at once (issue 25): what one user can and cannot take from the others.

Real daemons, real Docker, busy but well-behaved tools: the pool's slots are shared max-min
fairly with a reserve for first calls (docs/design.md, "Sharing the pool"). Timing bounds
here are far from what the mechanism gives (a newcomer waits for one sandbox start, ~0.5 s;
without the reserve it waits for the first 40-s call to end), so a slow machine does not
turn them red; the figures themselves are `make bench`'s ("noisy neighbours").
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from bench.source import Source
from sandboxd.server.connection import RefusedPeers
from tests.e2e.neighbours import Background, Pinger, Spent, percentile, wait_for_pool, warm_call_seconds

pytestmark = pytest.mark.docker

HEAVY = [f"heavy{i}@example.com" for i in range(8)]
NEWCOMERS = [f"new{i}@example.com" for i in range(4)]


def test_a_user_with_nothing_running_is_served_while_eight_users_hold_every_slot(make_daemon: Any) -> None:
    # The case: 8 users x 6 calls of 40 s, max_per_user 4, max_total 32 (reserve: the default, 4).
    daemon = make_daemon(config="pool:\n  max_per_user: 4\n  max_total: 32\n  acquire_timeout_ms: 60000\n")
    background = Background(daemon)
    try:
        for user in HEAVY:
            for _ in range(6):
                background.call(user, "sleeper", {"ms": 40_000}, timeoutMs=60_000)
        pool = wait_for_pool(daemon, lambda p: p["totals"]["busy"] >= 28 and p["totals"]["starting"] == 0, 90,
                             "eight users filling the pool")
        filled_at = time.monotonic()

        newcomers = [background.call(user, "hello", {"name": user}) for user in NEWCOMERS]
        background.wait(newcomers, 15)
        for outcome in newcomers:
            assert outcome.result is not None and outcome.result["status"] == "ok", (outcome, daemon.log())
            assert outcome.seconds is not None and outcome.seconds <= 3.0, [o.seconds for o in newcomers]
        assert all(o.answered_at is not None and o.answered_at - filled_at < 40 for o in newcomers)
        # Calls beyond a user's first stopped at max_total - reserve; everyone got at least three.
        holding = {user: pool["users"][user]["holding"] for user in HEAVY}
        assert sum(holding.values()) == 28 and min(holding.values()) >= 3, pool
        assert all(pool["users"][user]["waiting"] == 6 - holding[user] for user in HEAVY), pool

        with daemon.client() as client:
            status = client.request("sandbox/status")
        # Nobody's running call was killed to make room.
        assert status["pool"]["counters"]["killed"] == 0 and status["pool"]["counters"]["crashed"] == 0
        assert status["pool"]["sharing"]["reserve"] == 4 and status["pool"]["sharing"]["activeUsers"] == 8
        assert sum(status["pool"]["users"][user]["holding"] for user in HEAVY) == 28
    finally:
        background.close()


def test_queued_callers_are_served_in_a_fair_order_across_users(make_daemon: Any) -> None:
    # a holds the whole (small) pool; b queues four callers, then c two. When a's two short calls
    # end, b and c (both holding none) get one sandbox each, and c's second caller reuses c's own:
    # c is done before b's first call, queued earlier, ends. Without fairness the freed sandboxes
    # go to b's queue until it is empty, and c waits behind it.
    daemon = make_daemon(config="pool:\n  max_per_user: 4\n  max_total: 4\n  reserve: 0\n  min_idle: 0\n"
                                "  acquire_timeout_ms: 60000\n")
    background = Background(daemon)
    try:
        for ms in (3000, 3000, 20000, 20000):
            background.call("a@example.com", "sleeper", {"ms": ms}, timeoutMs=60_000)
        wait_for_pool(daemon, lambda p: p["totals"]["busy"] == 4, 60, "a filling the pool")
        b_calls = [background.call("b@example.com", "sleeper", {"ms": 3000}, timeoutMs=60_000) for _ in range(4)]
        wait_for_pool(daemon, lambda p: p["totals"]["waiting"] == 4, 30, "b's callers queueing")
        late = [background.call("c@example.com", "hello", {"name": "c"}) for _ in range(2)]
        wait_for_pool(daemon, lambda p: p["totals"]["waiting"] == 6, 30, "c's callers queueing")
        background.wait(late, 30)
        for outcome in late:
            assert outcome.result is not None and outcome.result["status"] == "ok", (outcome, daemon.log())
        c_done = max(o.answered_at for o in late if o.answered_at is not None)
        background.wait(b_calls, 30)
        assert all(o.result is not None and o.result["status"] == "ok" for o in b_calls), b_calls
        b_first = min(o.answered_at for o in b_calls if o.answered_at is not None)
        assert c_done < b_first, f"c done {b_first - c_done:.1f} s after b's first call"
        with daemon.client() as client:
            pool = client.request("sandbox/status")["pool"]
        assert pool["counters"]["killed"] == 0 and pool["refusals"] == {"user_limit": 0, "reserve": 0, "pool_full": 0}
    finally:
        background.close()


BYSTANDER = "bystander@example.com"


def _report(what: str, **figures: Any) -> None:
    print(f"\n[noisy neighbours] {what}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


def _downloads(daemon: Any, source: Source, count: int, seconds: float) -> tuple[Background, list[Any]]:
    """``count`` users' sandboxes each downloading from ``source`` as fast as they may, for ``seconds``."""
    background = Background(daemon)
    pumps = [background.call(f"pump{i}@example.com", "egress_probe",
                             {"mode": "pump", "url": source.url, "seconds": seconds}, timeoutMs=120_000)
             for i in range(count)]
    wait_for_pool(daemon, lambda p: sum(p["users"].get(f"pump{i}@example.com", {}).get("busy", 0)
                                        for i in range(count)) == count, 60, f"{count} downloads starting")
    time.sleep(2)  # every download under way, past its first second's burst
    return background, pumps


def test_the_control_plane_stays_fast_while_eight_sandboxes_download(make_daemon: Any) -> None:
    """Eight sandboxes at their full egress rate (8 x 16 MiB/s, the default total): a bystander's
    ping p99 <= 10 ms (beyond a yardstick's, neighbours.Pinger) and warm call p50 <= 3x quiet (the
    issue's targets; beyond what the yardstick's p50 rose by), and the bytes cost the daemon at most a quarter of a core (splice: 0.5-1.1 ms
    of CPU per MiB here; copying them through asyncio streams cost ~2 ms)."""
    with Source() as source:
        daemon = make_daemon(env={"SANDBOXD_EGRESS_ALLOW": f'["127.0.0.1:{source.port}"]'})
        quiet_calls = warm_call_seconds(daemon, BYSTANDER, 300)
        with Pinger(daemon) as quiet:
            time.sleep(3)
        background, pumps = _downloads(daemon, source, 8, seconds=20)
        try:
            sent_before = source.sent
            with Spent(daemon) as spent:  # the downloads alone
                time.sleep(4)
            moved_mib = (source.sent - sent_before) / (1 << 20)
            loaded_at = time.monotonic()
            with Pinger(daemon) as loaded:
                loaded_calls = warm_call_seconds(daemon, BYSTANDER, 300)
                time.sleep(max(0.0, 6 - (time.monotonic() - loaded_at)))
            background.wait(pumps, 60)
        finally:
            background.close()
        for outcome in pumps:
            assert outcome.result is not None and outcome.result["status"] == "ok", outcome
        ping = (quiet.p99_ms(), loaded.p99_ms())
        call = (percentile(quiet_calls, 0.5) * 1000, percentile(loaded_calls, 0.5) * 1000)
        cpu_ms_per_mib = spent.cpu_s * 1000 / moved_mib
        _report("eight sandboxes downloading", mib_s=round(moved_mib / spent.wall_s), daemon_cores=round(spent.cores, 3),
                cpu_ms_per_mib=round(cpu_ms_per_mib, 2), ping_p99_ms=[round(x, 2) for x in ping],
                yardstick_p99_ms=[round(quiet.yardstick_p99_ms(), 2), round(loaded.yardstick_p99_ms(), 2)],
                yardstick_p50_ms=[round(quiet.yardstick_p50_ms(), 2), round(loaded.yardstick_p50_ms(), 2)],
                call_p50_ms=[round(x, 2) for x in call])
        assert moved_mib / spent.wall_s > 64, "the downloads did not run at their rate"
        assert ping[1] <= loaded.bound_ms(), (ping, loaded.yardstick_p99_ms())
        # 3x quiet (the issue's), on top of what the machine's scheduler added meanwhile: a warm call
        # wakes two processes in turn (the daemon, the sandbox's node), each as slow to wake as the
        # yardstick's round trip. A loop taken by the bytes (tens of ms) is over it on any machine.
        machine_ms = max(0.0, loaded.yardstick_p50_ms() - quiet.yardstick_p50_ms())
        assert call[1] <= 3 * call[0] + 2 * machine_ms, (call, machine_ms)
        # The bytes' cost to the daemon, within the budget the issue gives a flood (0.25 core): splice
        # costs 0.5-1.1 ms of CPU per MiB here (by how busy the machine is), 0.06-0.15 core.
        assert spent.cores <= 0.25, (spent.cores, cpu_ms_per_mib)


def test_a_daemon_wide_egress_budget_is_shared_equally(make_daemon: Any) -> None:
    """egress.total_rate_bytes 48 MiB/s among eight downloading sandboxes: 6 MiB/s each, the total held."""
    total = 48 << 20
    with Source() as source:
        daemon = make_daemon(env={"SANDBOXD_EGRESS_ALLOW": f'["127.0.0.1:{source.port}"]',
                                  "SANDBOXD_EGRESS_TOTAL_RATE_BYTES": str(total)})
        background, pumps = _downloads(daemon, source, 8, seconds=12)
        try:
            background.wait(pumps, 60)
        finally:
            background.close()
        rates = []
        for outcome in pumps:
            assert outcome.result is not None and outcome.result["status"] == "ok", outcome
            report = json.loads(outcome.result["content"][0]["text"])
            rates.append(report["bytes"] / (report["ms"] / 1000))
        _report("eight sandboxes under a 48 MiB/s total", mib_s=[round(r / (1 << 20), 1) for r in rates])
        # Each got about its share (the first second's burst of its own rate comes on top).
        assert sum(rates) <= total * 1.3, rates
        assert min(rates) >= total / 8 * 0.6, rates


def test_a_refused_connection_flood_from_four_sandboxes_costs_the_daemon_little(make_daemon: Any) -> None:
    """Four sandboxes each opening refused CONNECTs in 24 loops for 10 s (the issue's case, on four):
    the daemon at most 0.25 core, its log at most 512 KiB, a bystander's ping p99 at most 10 ms
    beyond a yardstick's. The
    destination, a private address, is refused by the policy before any connect."""
    daemon = make_daemon()
    warm_call_seconds(daemon, BYSTANDER, 10)
    background = Background(daemon)
    for i in range(4):
        background.call(f"flood{i}@example.com", "egress_probe", {"mode": "routes"})
    wait_for_pool(daemon, lambda p: sum(p["users"].get(f"flood{i}@example.com", {}).get("idle", 0)
                                        for i in range(4)) >= 4, 60, "four sandboxes warm")
    floods = [background.call(f"flood{i}@example.com", "egress_probe",
                              {"mode": "flood", "request": "CONNECT 10.0.0.5:443 HTTP/1.1\r\n\r\n", "port": 24,
                               "seconds": 10}, timeoutMs=60_000) for i in range(4)]
    time.sleep(0.5)
    try:
        with Spent(daemon) as spent, Pinger(daemon) as loaded:
            background.wait(floods, 40)
    finally:
        background.close()
    outcomes: dict[str, int] = {}
    for outcome in floods:
        assert outcome.result is not None and outcome.result["status"] == "ok", outcome
        for key, count in json.loads(outcome.result["content"][0]["text"]).items():
            outcomes[key] = outcomes.get(key, 0) + count
    refused = outcomes.get("HTTP/1.1 403 Forbidden", 0)
    ping_p99 = loaded.p99_ms()
    _report("refused-connection flood, four sandboxes x 24 loops, 10 s", daemon_cores=round(spent.cores, 3),
            log_kib=round(spent.log_bytes / 1024), ping_p99_ms=round(ping_p99, 2),
            yardstick_p99_ms=round(loaded.yardstick_p99_ms(), 2), outcomes=outcomes)
    assert refused > 0 and not [k for k in outcomes if k.startswith("HTTP/") and "403" not in k], outcomes
    # egress.refusal_cost (5) of egress.connect_rate (50/s) each: ten refusals a second a sandbox, after a
    # burst of ten (at a refusal_cost of 1, ~2,300 in all).
    assert refused <= 4 * 10 * (10 + 1 + 5), refused
    assert spent.cores <= 0.25, spent.cores
    assert spent.log_bytes <= 512 << 10, spent.log_bytes
    assert ping_p99 <= loaded.bound_ms(), (ping_p99, loaded.yardstick_p99_ms())


def test_a_sandboxs_egress_lines_are_held_to_its_budget(make_daemon: Any) -> None:
    """Refusals at the full connect_rate (refusal_cost 1: 50 a second, a sandbox's worst with the
    cost lifted): the sandbox's egress lines stay within log_burst + log_rate x t, and one summary
    line counts the rest, so logged + dropped is every decision."""
    daemon = make_daemon(config="egress:\n  refusal_cost: 1\n")
    background = Background(daemon)
    started = time.monotonic()
    flood = background.call("flood@example.com", "egress_probe",
                            {"mode": "flood", "request": "CONNECT 10.0.0.5:443 HTTP/1.1\r\n\r\n", "port": 24,
                             "seconds": 5}, timeoutMs=60_000)
    try:
        background.wait([flood], 60)
    finally:
        background.close()
    assert flood.result is not None and flood.result["status"] == "ok", flood
    refused = json.loads(flood.result["content"][0]["text"]).get("HTTP/1.1 403 Forbidden", 0)
    with daemon.client() as client:
        client.request("ping")
    deadline = time.monotonic() + 15
    while not daemon.events("log_lines_dropped") and time.monotonic() < deadline:
        time.sleep(0.5)
    logged = daemon.events("egress", user="flood@example.com")
    top = daemon.events("log_lines_dropped")[0]["by_source"][0]
    _report("one sandbox's refusals at the full connect rate, 5 s", refused=refused, logged=len(logged),
            dropped=top["dropped"])
    assert refused > 200, refused  # 50 a second, after a burst of 50
    assert len(logged) <= 100 + 10 * (time.monotonic() - started) + 10, len(logged)
    assert (top["source"], top["event"]) == ("sandbox", "egress") and len(logged) + top["dropped"] >= refused, top


# Another uid's client: the system's Python (the test's own may sit below a home only root may enter).
SYSTEM_PYTHON = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else sys.executable
_CONNECT_AND_GO = """
import socket, sys, time
path, until, n = sys.argv[1], time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < until:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)  # and gone at once: no waiting for the answer
    n += 1
print(n)
"""
_RECONNECT = """
import socket, sys, time
path, until, n = sys.argv[1], time.monotonic() + float(sys.argv[2]), 0
while time.monotonic() < until:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.recv(4096)  # the one error line, then the daemon closes
    n += 1
print(n)
"""


def test_a_refused_client_reconnecting_in_a_loop_costs_the_log_a_bounded_amount(make_daemon: Any) -> None:
    """A client whose uid may not use the daemon, reconnecting as fast as it can for 5 s: each
    connection is refused after the door's delay (0.5 s), so it makes ten, not 60,000 (0.75 of a
    core); and however many it makes, its uid's log budget holds their lines to log_burst +
    log_rate x 5 s, and one summary line says how many went. Eight such clients at once. What
    they cost the daemon is over what the bystander's pings alone cost it (~0.05 core)."""
    daemon = make_daemon(config="allowed_uids: [4242]\nsocket_mode: '0666'\n", start=False)
    daemon.socket.parent.chmod(0o755)  # the client, uid 65534, must reach the socket
    daemon.start()
    deadline = time.monotonic() + 30  # start-up's own work done: the tools transpiled
    while not daemon.events("transpile_cache_filled") and time.monotonic() < deadline:
        time.sleep(0.1)
    with Spent(daemon) as pings_alone, Pinger(daemon):
        time.sleep(3)
    with Spent(daemon) as spent, Pinger(daemon) as bystander:
        clients = [subprocess.Popen([SYSTEM_PYTHON, "-c", _RECONNECT, str(daemon.socket), "5"], user=65534, cwd="/",
                                    stdout=subprocess.PIPE, text=True) for _ in range(8)]
        connections = sum(int(client.communicate(timeout=60)[0]) for client in clients)
    refusals = daemon.events("peer_refused", uid=65534)
    ping_p99 = bystander.p99_ms()
    _report("eight refused clients reconnecting for 5 s", connections=connections, logged=len(refusals),
            log_kib=round(spent.log_bytes / 1024), daemon_cores=round(spent.cores, 3),
            pings_alone_cores=round(pings_alone.cores, 3), ping_p99_ms=round(ping_p99, 2),
            yardstick_p99_ms=round(bystander.yardstick_p99_ms(), 2))
    assert connections <= 8 * (5 / RefusedPeers.DELAY_S + 1), connections
    assert spent.cores - pings_alone.cores <= 0.1, (spent.cores, pings_alone.cores)
    assert len(refusals) == connections and spent.log_bytes <= 64 << 10, (len(refusals), spent.log_bytes)
    assert ping_p99 <= bystander.bound_ms(), (ping_p99, bystander.yardstick_p99_ms())


def test_a_refused_peers_lines_are_held_to_its_uids_budget(make_daemon: Any) -> None:
    """Without the door's delay (a client that never waits for its answer, in many processes): the
    log holds log_burst + log_rate x t lines of that uid, and one summary line counts the rest."""
    daemon = make_daemon(config="allowed_uids: [4242]\nsocket_mode: '0666'\n", start=False)
    daemon.socket.parent.chmod(0o755)
    daemon.start()
    started = time.monotonic()
    clients = [subprocess.Popen([SYSTEM_PYTHON, "-c", _CONNECT_AND_GO, str(daemon.socket), "3"], user=65534, cwd="/",
                                stdout=subprocess.PIPE, text=True) for _ in range(4)]
    connections = sum(int(client.communicate(timeout=60)[0]) for client in clients)
    time.sleep(RefusedPeers.DELAY_S * 2)  # the last held ones answered
    refusals = daemon.events("peer_refused", uid=65534)
    _report("refused clients connecting and leaving for 3 s", connections=connections, logged=len(refusals))
    assert connections > 300, connections
    assert len(refusals) <= 100 + 10 * (time.monotonic() - started) + 10, len(refusals)
    deadline = time.monotonic() + 15
    while not daemon.events("log_lines_dropped") and time.monotonic() < deadline:
        time.sleep(0.5)
    top = daemon.events("log_lines_dropped")[0]["by_source"][0]
    assert (top["source"], top["who"], top["event"]) == ("peer", "65534", "peer_refused") and top["dropped"] > 0
    assert len(refusals) + top["dropped"] >= connections * 0.9, (len(refusals), top, connections)


def test_a_client_calling_a_failing_tool_in_a_loop_costs_the_log_a_bounded_amount(make_daemon: Any) -> None:
    """Every call is answered and counted, but the user's call lines (each with its error) are held to
    the user's budget: the worst a well-formed client can do to the log."""
    daemon = make_daemon()
    calls, started = 0, time.monotonic()
    with daemon.client() as client:
        while time.monotonic() - started < 5:
            result = client.call_tool("looper@example.com", "thrower", {})
            assert result["status"] == "error" and "the database is on fire" in result["content"][0]["text"]
            calls += 1
        status = client.request("sandbox/status")
        if status["calls"].get("error") != calls:  # the last call is counted just after its answer
            time.sleep(0.1)
            status = client.request("sandbox/status")
    logged = daemon.events("call", user="looper@example.com")
    _report("a client calling a failing tool for 5 s", calls=calls, logged=len(logged))
    assert status["calls"]["error"] == calls
    assert calls > 300, calls
    assert len(logged) <= 100 + 10 * (time.monotonic() - started) + 10, len(logged)


def test_a_client_pipelining_thousands_of_requests_does_not_hold_the_loop(make_daemon: Any) -> None:
    """One write of 50,000 pings: the daemon works through them LINES_PER_TURN at a time, so a
    bystander's pings are answered in between (without the turns it waited for most of them:
    ~1 s at ~20 µs each); the flood gets every answer."""
    daemon = make_daemon()
    count = 50_000
    flood = socket.socket(socket.AF_UNIX)
    flood.connect(str(daemon.socket))
    answers = bytearray()

    def read_answers() -> None:
        while answers.count(b"\n") < count:
            data = flood.recv(1 << 20)
            if not data:
                return
            answers.extend(data)

    reader = threading.Thread(target=read_answers, daemon=True)
    reader.start()
    with Pinger(daemon, interval_s=0.001) as bystander:
        time.sleep(0.3)
        flood.sendall(b"".join(b'{"jsonrpc":"2.0","id":%d,"method":"ping"}\n' % i for i in range(count)))
        reader.join(60)
        time.sleep(0.2)
    flood.close()
    ping_p99, ping_max = bystander.p99_ms(), max(bystander.seconds) * 1000
    yardstick_p99, yardstick_max = bystander.yardstick_p99_ms(), max(bystander.yardstick_seconds) * 1000
    _report("a client pipelining 50,000 pings", bystander_ping_p99_ms=round(ping_p99, 2),
            bystander_ping_max_ms=round(ping_max, 2), yardstick_p99_ms=round(yardstick_p99, 2),
            yardstick_max_ms=round(yardstick_max, 2), answered=answers.count(b"\n"))
    assert answers.count(b"\n") == count
    # Without the turns: p99 88-96 ms, max 103-115 ms; with them 5 ms (11 ms at most) on a quiet
    # machine. The bounds leave room for a busy one, and a slow scheduler is the yardstick's too.
    assert ping_p99 <= 20 + yardstick_p99 and ping_max <= 50 + yardstick_max, (ping_p99, ping_max, yardstick_p99,
                                                                             yardstick_max)
