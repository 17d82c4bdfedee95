"""Tunnels stalled both ways stay inside the daemon's descriptor budget (issue 44, item 4), end to end.

A hostile tool opens every tunnel its sandboxes may hold to an upstream that never reads, writes
into each without end and never reads what comes back. Each direction of each tunnel then holds
bytes the other side does not take. Before, each such direction held a pipe (two descriptors)
outside the budget: at the least limit start-up accepted, the daemon ran out of descriptors, a
new user's first call failed and a bystander's warm call took 35 s. Now the relay holds at most
``RELAY_PIPES`` pipes (service/fds.py), which the budget counts; a direction past them waits
in a buffer. And each upstream socket lets at most ``UNSENT_BYTES`` wait unsent, where the
kernel let tcp_wmem's 4 MiB wait (1.2 GiB for these tunnels, past the host's TCP pressure mark).

The daemon runs in a network namespace with only a loopback device; the tunnels go to a server
this test starts in that namespace, on 127.0.0.1, which egress.allow names.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sandboxd.config import load_config
from sandboxd.egress.relay import UNSENT_BYTES
from sandboxd.errors import ConfigError
from sandboxd.service.fds import RELAY_PIPE_FDS, FdBudget
from tests.e2e.conftest import Daemon
from tests.e2e.hostile_harness import HOSTILE_TOOLS
from tests.e2e.neighbours import Background, Pinger, Spent, percentile, warm_call_seconds

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]
PORT = 18098  # in the daemon's own network namespace, where nothing else listens
MAX_TOTAL, MAX_CONNECTIONS = 12, 32
# Ten sandboxes of the twelve: the bystander holds one, and the last is the reserve a newcomer's first call takes.
STALLING = [f"staller{i}@example.com" for i in range(3) for _ in range(4)][:10]
BYSTANDER, NEWCOMER = "bystander@example.com", "newcomer@example.com"
HOLD_S = 60
CONFIG = (f"pool:\n  max_total: {MAX_TOTAL}\n  max_per_user: 4\n  acquire_timeout_ms: 60000\n"
          f"egress:\n  allow: ['127.0.0.1:{PORT}']\n  max_connections: {MAX_CONNECTIONS}\n")


def least_limit(config_path: Path) -> int:
    """The least RLIMIT_NOFILE start-up accepts for the configuration (FdBudget.plan's own figure)."""
    config = load_config(config_path, environ={})
    low, high = 1, 1 << 20
    while low < high:
        middle = (low + high) // 2
        try:
            FdBudget.plan(config, middle)
            high = middle
        except ConfigError:
            low = middle + 1
    return low


def _descriptors(pid: int) -> tuple[int, int]:
    """(descriptors, pipe ends) the process holds."""
    fds = pipes = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        fds += 1
        pipes += target.startswith("pipe:")
    return fds, pipes


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def _until_stalled(daemon: Daemon, timeout: float = 60) -> float:
    """Seconds until every tunnel holds what it may and the daemon moves nothing more (under 0.05 core
    for a second): each sandbox fills its tunnels' buffers at its egress.rate_bytes first."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        with Spent(daemon) as second:
            time.sleep(1)
        if second.cores < 0.05:
            return time.monotonic() - started
    raise AssertionError(f"the tunnels did not stall within {timeout:g} s: the daemon still moves bytes")


def _queued_upstream(pid: int) -> int:
    """Bytes the daemon's sockets to the upstream hold unacknowledged (Send-Q): what its kernel queues
    for an upstream that never reads."""
    out = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "ss", "-tnH", "state", "established",
                          f"( dport = :{PORT} )"], capture_output=True, text=True, check=True).stdout
    return sum(int(line.split()[1]) for line in out.splitlines() if line.strip())


class Peak:
    """The most descriptors and pipe ends the daemon held, sampled every 0.1 s until ``stop``."""

    def __init__(self, pid: int) -> None:
        self.fds = self.pipes = 0
        self._pid, self._stop = pid, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            try:
                fds, pipes = _descriptors(self._pid)
            except OSError:
                return
            self.fds, self.pipes = max(self.fds, fds), max(self.pipes, pipes)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_tunnels_stalled_both_ways_at_the_least_limit_leave_newcomers_and_bystanders_served(
        make_daemon: Any, stopper: list[subprocess.Popen[str]]) -> None:
    daemon: Daemon = make_daemon(config=CONFIG, loopback_only=True, start=False)
    limit = least_limit(daemon.config_path)
    daemon.nofile = (limit, limit)
    shutil.copytree(HOSTILE_TOOLS / "tunnel_staller", daemon.data / "tools" / "tunnel_staller")
    daemon.start()
    assert daemon.proc is not None
    pid = daemon.proc.pid
    # The upstream: never reads, sends until each connection takes no more (bench/stalling.py).
    server = subprocess.Popen(["nsenter", f"--net=/proc/{pid}/ns/net", sys.executable, "-m", "bench.stalling", str(PORT)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    stopper.append(server)
    assert server.stdout is not None and server.stdout.readline().strip() == "listening"

    warm_call_seconds(daemon, BYSTANDER, 20)
    with Pinger(daemon) as quiet_machine:
        quiet = warm_call_seconds(daemon, BYSTANDER, 200)
    _, quiet_pipes = _descriptors(pid)
    quiet_rss_mib = _rss_mib(pid)
    background = Background(daemon)
    stalls = [background.call(user, "tunnel_staller", {"target": f"127.0.0.1:{PORT}", "count": MAX_CONNECTIONS + 4,
                                                       "seconds": HOLD_S}, timeoutMs=120_000)
              for user in STALLING]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(daemon.events("egress", decision="allowed")) < len(STALLING) * MAX_CONNECTIONS:
            time.sleep(0.5)
        tunnels = len(daemon.events("egress", decision="allowed"))
        peak = Peak(pid)
        filled_s = _until_stalled(daemon)
        with Spent(daemon) as stalled:  # what the stalled tunnels alone cost the daemon
            time.sleep(3)
        rss_mib, queued = _rss_mib(pid), _queued_upstream(pid)
        with Pinger(daemon) as loaded_machine:
            loaded = warm_call_seconds(daemon, BYSTANDER, 200)
        with daemon.client() as client:
            first = client.call_tool(NEWCOMER, "hello", {"name": "newcomer"}, timeoutMs=60_000)
        peak.stop()
        held_throughout = all(outcome.seconds is None for outcome in stalls)
    finally:
        background.close()  # the stallers' calls end with their connections: cancelled, their tunnels closed

    quiet_ms, loaded_ms = percentile(quiet, 0.5) * 1000, percentile(loaded, 0.5) * 1000
    # What the machine's scheduler added meanwhile (the yardstick's p50), as test_many_users allows for it.
    machine_ms = max(0.0, loaded_machine.yardstick_p50_ms() - quiet_machine.yardstick_p50_ms())
    print(f"limit {limit}; tunnels allowed {tunnels}; peak {peak.fds} descriptors, {peak.pipes} pipe ends "
          f"({quiet_pipes} quiet); filled in {filled_s:.1f} s, then {stalled.cores:.3f} cores; RSS {quiet_rss_mib:.0f} -> "
          f"{rss_mib:.0f} MiB; {queued / (1 << 20):.0f} MiB queued to the upstream; bystander's warm call p50 "
          f"{quiet_ms:.2f} -> {loaded_ms:.2f} ms (machine +{machine_ms:.2f} ms)")
    log = daemon.log_path.read_text(errors="replace")
    for sign in ("EMFILE", "Errno 24", "Too many open files", "accept_failed"):
        assert sign not in log, f"{sign!r} in the daemon's log"
    assert tunnels >= len(STALLING) * MAX_CONNECTIONS * 0.9, "the stallers held their tunnels: the daemon was under attack"
    assert held_throughout, "the stallers' calls were answered before the bystander was measured: raise HOLD_S"
    assert first["status"] == "ok", f"a new user's first call: {first}"
    assert loaded_ms <= 2 * quiet_ms + 2 * machine_ms, \
        f"the bystander's warm call went from {quiet_ms:.2f} to {loaded_ms:.2f} ms (the machine: +{machine_ms:.2f} ms)"
    assert peak.fds < limit, f"{peak.fds} descriptors open at the peak, of {limit}"
    assert peak.pipes - quiet_pipes <= RELAY_PIPE_FDS, f"{peak.pipes} pipe ends open at the peak ({quiet_pipes} quiet)"
    # Each tunnel's unsent bytes stop at UNSENT_BYTES (and one write past it); before, tcp_wmem's 4 MiB each.
    assert queued <= tunnels * 2 * UNSENT_BYTES, f"{queued >> 20} MiB queued for the upstream by {tunnels} tunnels"
