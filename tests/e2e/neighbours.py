"""Many users at once, for the noisy-neighbour tests: calls held open in threads, a bystander
pinging and calling, and what the daemon spent (CPU from /proc, log bytes).

Nothing here leaves the machine: the daemons are the e2e harness's (tests/e2e/conftest.py),
and any server a test starts listens on 127.0.0.1.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from bench import stats
from bench.yardstick import Yardstick
from sandboxd.client import Client, DaemonUnreachable, RpcError
from tests.e2e.conftest import Daemon


@dataclass
class Outcome:
    """One call made in the background: its result (or the error), and how long it took."""

    user: str
    result: dict[str, Any] | None = None
    error: RpcError | None = None
    seconds: float | None = None
    answered_at: float | None = None  # time.monotonic()


@dataclass
class Background:
    """Calls made from threads, one connection each; ``close`` disconnects them all (which cancels)."""

    daemon: Daemon
    outcomes: list[Outcome] = field(default_factory=list)
    _clients: list[Client] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def call(self, user: str, tool: str, arguments: dict[str, Any], **extra: Any) -> Outcome:
        outcome = Outcome(user)
        client = self.daemon.client(timeout=None)
        self._clients.append(client)

        def run() -> None:
            started = time.monotonic()
            try:
                outcome.result = client.call_tool(user, tool, arguments, **extra)
            except RpcError as exc:
                outcome.error = exc
            except (DaemonUnreachable, OSError):
                return  # closed by close()
            outcome.answered_at = time.monotonic()
            outcome.seconds = outcome.answered_at - started

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self._threads.append(thread)
        self.outcomes.append(outcome)
        return outcome

    def wait(self, outcomes: list[Outcome], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(o.seconds is None for o in outcomes):
            time.sleep(0.05)

    def close(self) -> None:
        for client in self._clients:
            client.close()
        for thread in self._threads:
            thread.join(10)


def wait_for_pool(daemon: Daemon, predicate: Any, timeout: float, what: str) -> dict[str, Any]:
    """Poll sandbox/status until ``predicate(pool)`` holds; the pool's status then."""
    deadline = time.monotonic() + timeout
    pool: dict[str, Any] = {}
    with daemon.client() as client:
        while time.monotonic() < deadline:
            pool = client.request("sandbox/status")["pool"]
            if predicate(pool):
                return pool
            time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout:g} s; the pool: {pool}\n{daemon.log()}")


def _ask(conn: socket.socket, request_id: int) -> float:
    """One ping on ``conn`` and its answer, read whole: the seconds it took."""
    started = time.perf_counter()
    conn.sendall(b'{"jsonrpc":"2.0","id":%d,"method":"ping"}\n' % request_id)
    answer = b""
    while not answer.endswith(b"\n"):
        data = conn.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection before answering a ping")
        answer += data
    if b'"result"' not in answer:
        raise AssertionError(f"a ping was not answered with a result: {answer[:300]!r}")
    return time.perf_counter() - started


class Pinger:
    """A bystander's pings, one after another on one connection, for as long as it runs; and beside
    each, the same ping to a yardstick (bench/yardstick.py), whose answers take what the machine's
    scheduler adds to any process at that moment; ``bound_ms`` takes it into account."""

    def __init__(self, daemon: Daemon, interval_s: float = 0.005) -> None:
        self._daemon, self._interval = daemon, interval_s
        self.seconds: list[float] = []
        self.yardstick_seconds: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._yardstick = Yardstick()
        self.error: BaseException | None = None

    def __enter__(self) -> Pinger:
        self._yardstick.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)
        self._yardstick.__exit__(*exc)
        if self.error is not None and exc[0] is None:
            raise AssertionError(f"the bystander's pings stopped: {self.error!r}") from self.error

    def _run(self) -> None:
        try:
            with socket.socket(socket.AF_UNIX) as daemon, socket.socket(socket.AF_UNIX) as yardstick:
                daemon.settimeout(30)
                yardstick.settimeout(30)
                daemon.connect(str(self._daemon.socket))
                yardstick.connect(self._yardstick.path)
                request_id = 0
                while not self._stop.is_set():
                    request_id += 1
                    self.seconds.append(_ask(daemon, request_id))
                    self.yardstick_seconds.append(_ask(yardstick, request_id))
                    self._stop.wait(self._interval)
        except BaseException as exc:  # said at __exit__, in the test's thread
            self.error = exc

    def p99_ms(self) -> float:
        return percentile(self.seconds, 0.99) * 1000

    def yardstick_p99_ms(self) -> float:
        return percentile(self.yardstick_seconds, 0.99) * 1000

    def yardstick_p50_ms(self) -> float:
        return percentile(self.yardstick_seconds, 0.5) * 1000

    def bound_ms(self) -> float:
        """The issue's bound on a bystander's ping p99 under a crowd, 10 ms, on top of what the
        yardstick's p99 was in the same moments: a crowd that takes the daemon's loop (before
        issue 25, 30-80 ms at p99 while the loop copied egress bytes) is over it on any machine,
        and a machine whose scheduler is slow for everyone (a clean CI run saw a quiet daemon's p99
        at 3.7 ms) does not turn it red."""
        return 10.0 + self.yardstick_p99_ms()


def percentile(values: list[float], q: float) -> float:
    """``q`` (0..1) of ``values``, nearest rank."""
    return stats.percentile(sorted(values), q * 100)


def warm_call_seconds(daemon: Daemon, user: str, count: int) -> list[float]:
    """``count`` hello calls of ``user`` one after another (the first, which may start a sandbox, not counted)."""
    out = []
    with daemon.client() as client:
        for i in range(count + 1):
            started = time.perf_counter()
            result = client.call_tool(user, "hello", {"name": "bystander"})
            elapsed = time.perf_counter() - started
            assert result["status"] == "ok", result
            if i:
                out.append(elapsed)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU the process has used so far (its threads included)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Spent:
    """What the daemon spent between entering and leaving: CPU seconds and log bytes."""

    def __init__(self, daemon: Daemon) -> None:
        self._daemon = daemon
        self.cpu_s = self.log_bytes = self.wall_s = 0.0

    def __enter__(self) -> Spent:
        assert self._daemon.proc is not None
        self._cpu, self._log, self._wall = cpu_seconds(self._daemon.proc.pid), self._daemon.log_path.stat().st_size, time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._daemon.proc is not None
        self.cpu_s = cpu_seconds(self._daemon.proc.pid) - self._cpu
        self.log_bytes = self._daemon.log_path.stat().st_size - self._log
        self.wall_s = time.monotonic() - self._wall

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0
