"""Prometheus metrics, served on a loopback address or a unix socket (``metrics.listen``).

Two kinds of numbers:

- per call, observed by the call runner as each call ends into plain counts
  (``CallStats``), read like the rest at scrape time;
- state the daemon already keeps (pool sizes, sandbox lifecycle counters,
  orphans reaped), read by a collector at scrape time, so nothing is counted twice.

The endpoint is a minimal HTTP/1.1 responder on the daemon's own event loop
rather than prometheus-client's threaded server: it can listen on a unix
socket, and collection reads loop-owned state from the loop, never from a thread.
"""

from __future__ import annotations

import asyncio
from bisect import bisect_left
from collections import defaultdict
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol

from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from sandboxd import __version__
from sandboxd.config import parse_listen_address
from sandboxd.logging import get_logger, lines_dropped
from sandboxd.unixsocket import bind_unix_socket

log = get_logger("sandboxd.metrics")

# `_created` series double every counter for a feature no dashboard here uses.
disable_created_metrics()

CALL_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
QUEUE_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_REQUEST_TIMEOUT_S = 5.0
_MAX_REQUEST_HEAD = 16 << 10


class Observed(Protocol):
    """What the metrics read of the daemon, at scrape time (``server.Server`` is one)."""

    def status(self) -> dict[str, Any]:
        """sandbox/status: the pool (totals, users, counters, refusals), calls in flight, connections, the backend."""

    @property
    def egress_decisions(self) -> Mapping[tuple[str, str], int]:
        """(decision, reason) → egress requests so far."""

    @property
    def egress_secret_uses(self) -> Mapping[str, int]:
        """egress.secrets name → requests the egress proxy put its value in."""

    @property
    def orphans_reaped(self) -> int: ...


class _ServerCollector:
    """Reads the daemon's own bookkeeping at scrape time."""

    def __init__(self, daemon: Observed) -> None:
        self._daemon = daemon

    def collect(self) -> Iterator[Metric]:
        daemon = self._daemon
        whole = daemon.status()
        status = whole["pool"]
        sandboxes = GaugeMetricFamily("sandboxd_sandboxes", "Sandboxes held, by state.", labels=["state"])
        for state in ("starting", "idle", "busy", "stopping"):
            sandboxes.add_metric([state], status["totals"][state])
        yield sandboxes
        yield GaugeMetricFamily("sandboxd_calls_queued", "Calls waiting for a sandbox.", value=status["totals"]["waiting"])
        # How the pool is shared, without users as a label (unbounded: a client can name endless
        # users, each one waiting; and personal): sandbox/status has the per-user rows.
        rows = status["users"].values()
        users = GaugeMetricFamily("sandboxd_pool_users", "Users holding sandboxes for calls (busy or starting), "
                                  "and users with calls waiting for one.", labels=["state"])
        users.add_metric(["holding"], sum(1 for row in rows if row["holding"]))
        users.add_metric(["waiting"], sum(1 for row in rows if row["waiting"]))
        yield users
        most = GaugeMetricFamily("sandboxd_pool_user_most", "The most any one user holds (busy or starting), and the "
                                 "most calls any one user has waiting.", labels=["state"])
        most.add_metric(["holding"], max((row["holding"] for row in rows), default=0))
        most.add_metric(["waiting"], max((row["waiting"] for row in rows), default=0))
        yield most
        refusals = CounterMetricFamily("sandboxd_pool_refusals", "Calls refused because no sandbox became free "
                                       "within pool.acquire_timeout_ms, by reason: user_limit (the user's "
                                       "max_per_user), reserve (kept for first calls), pool_full.", labels=["reason"])
        for reason, count in status["refusals"].items():
            refusals.add_metric([reason], count)
        yield refusals
        yield GaugeMetricFamily("sandboxd_calls_in_flight", "Calls accepted and not yet answered.", value=whole["callsInFlight"])
        yield GaugeMetricFamily("sandboxd_connections", "Open client connections.", value=whole["connections"])
        counters = status["counters"]
        for name, key, help_text in (
            ("sandboxd_sandbox_starts", "started", "Sandboxes started."),
            ("sandboxd_sandbox_start_failures", "start_failures", "Sandbox starts that failed or timed out."),
            ("sandboxd_sandbox_kills", "killed", "Sandboxes killed mid-call: timeouts and cancels past the grace."),
            ("sandboxd_sandbox_crashes", "crashed", "Sandboxes that died by themselves: memory limit, exit, engine."),
            ("sandboxd_sandboxes_destroyed", "destroyed", "Sandboxes removed for any reason, recycling included."),
        ):
            yield CounterMetricFamily(name, help_text, value=counters.get(key, 0))
        egress = CounterMetricFamily("sandboxd_egress_requests", "Egress requests from sandboxes, by decision "
                                     "(allowed, refused, failed) and reason.", labels=["decision", "reason"])
        for (decision, reason), count in sorted(daemon.egress_decisions.items()):
            egress.add_metric([decision, reason], count)
        yield egress
        uses = CounterMetricFamily("sandboxd_egress_secret_uses", "Requests the egress proxy put a secret's real "
                                   "value in (egress.secrets), by the secret's name.", labels=["name"])
        for name, count in sorted(daemon.egress_secret_uses.items()):
            uses.add_metric([name], count)
        yield uses
        dropped = CounterMetricFamily("sandboxd_log_lines_dropped", "Log lines over their source's budget (log_rate, "
                                      "log_burst), by the kind of source: sandbox, user, peer, method, calls.",
                                      labels=["source"])
        for kind, count in sorted(lines_dropped().items()):
            dropped.add_metric([kind], count)
        yield dropped
        yield CounterMetricFamily("sandboxd_orphans_reaped", "Containers left by an earlier run, removed at start-up.",
                                  value=daemon.orphans_reaped)
        yield from _storage_metrics(whole.get("storage"))
        info = GaugeMetricFamily("sandboxd_build_info", "Always 1; the labels say what runs.", labels=["version", "backend"])
        info.add_metric([__version__, whole["backend"]], 1)
        yield info


def _storage_metrics(storage: Mapping[str, Any] | None) -> Iterator[Metric]:
    """Each user's disk usage and quota (storage/quota.py). By user: only users with folders on disk have a
    row, and an operator needs to know whose folders fill the disk."""
    if storage is None:
        return
    families = [GaugeMetricFamily(name, help_text, labels=["user"]) for name, help_text in (
        ("sandboxd_user_disk_bytes", "Bytes a user's folders hold (DATA_PATH/<user> and the email folder), as last measured."),
        ("sandboxd_user_disk_limit_bytes", "A user's byte quota (storage.quota_bytes)."),
        ("sandboxd_user_disk_inodes", "Files and folders a user's folders hold, as last measured."),
        ("sandboxd_user_disk_limit_inodes", "A user's file quota (storage.quota_inodes)."),
    )]
    for user, row in storage["users"].items():
        for family, key in zip(families, ("bytes", "limitBytes", "inodes", "limitInodes")):
            family.add_metric([user], row[key])
    yield from families
    yield CounterMetricFamily("sandboxd_quota_refusals", "Calls refused because the user's folders were over quota.",
                              value=storage["refusals"])


class _Buckets:
    """One histogram's counts per bucket (not cumulative: one increment per observation) and sum."""

    __slots__ = ("counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound (+Inf)
        self.total = 0.0

    def observe(self, bounds: tuple[float, ...], value: float) -> None:
        self.counts[bisect_left(bounds, value)] += 1  # le: a value equal to a bound counts in its bucket
        self.total += value

    def cumulative(self, bounds: tuple[float, ...]) -> list[tuple[str, float]]:
        return list(zip([*map(floatToGoString, bounds), "+Inf"], accumulate(self.counts)))


class CallStats:
    """The per-call numbers, as the call runner observes each call's end: calls by tool and status, how
    long they took by tool, how long they waited for a sandbox. A collector of them at scrape time."""

    def __init__(self) -> None:
        # Tools are the catalog's (a call to an unknown one is refused first), statuses few: both bounded.
        self.counts: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.durations: defaultdict[str, _Buckets] = defaultdict(partial(_Buckets, CALL_SECONDS_BUCKETS))
        self.queue_waits = _Buckets(QUEUE_SECONDS_BUCKETS)

    def observe(self, tool: str, status: str, duration_s: float, queue_wait_s: float | None) -> None:
        self.counts[tool, status] += 1
        self.durations[tool].observe(CALL_SECONDS_BUCKETS, duration_s)
        if queue_wait_s is not None:
            self.queue_waits.observe(QUEUE_SECONDS_BUCKETS, queue_wait_s)

    def collect(self) -> Iterator[Metric]:
        calls = CounterMetricFamily("sandboxd_calls", "Tool calls answered, by tool and status.", labels=["tool", "status"])
        for (tool, status), count in sorted(self.counts.items()):
            calls.add_metric([tool, status], count)
        yield calls
        durations = HistogramMetricFamily("sandboxd_call_duration_seconds", "Time from a call's arrival to its answer.",
                                          labels=["tool"])
        for tool, buckets in sorted(self.durations.items()):
            durations.add_metric([tool], buckets.cumulative(CALL_SECONDS_BUCKETS), buckets.total)
        yield durations
        waits = HistogramMetricFamily("sandboxd_queue_wait_seconds", "Time a call waited for a sandbox.")
        waits.add_metric([], self.queue_waits.cumulative(QUEUE_SECONDS_BUCKETS), self.queue_waits.total)
        yield waits


class Metrics:
    def __init__(self, daemon: Observed) -> None:
        self.registry = CollectorRegistry()
        # Counted in plain lists and read at scrape time: prometheus-client's children take a lock per
        # increment and walk the buckets per observation, on every call.
        self.calls = CallStats()
        self.registry.register(self.calls)
        # Told (tool, status, duration_s, queue_wait_s) by the call runner as each call ends; no hop of its own.
        self.observe_call: Callable[[str, str, float, float | None], None] = self.calls.observe
        self.registry.register(_ServerCollector(daemon))
        ProcessCollector(registry=self.registry)
        self._listener: asyncio.AbstractServer | None = None
        self._socket_path: Path | None = None

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition (text, or OpenMetrics when the scraper asks for it) and its content type."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type

    # -- the endpoint ------------------------------------------------------------

    async def start(self, listen: str, *, socket_group: str | None = None) -> str:
        """Serve /metrics on ``listen``; returns the address actually bound (port 0 picks one)."""
        address = parse_listen_address(listen)
        if isinstance(address, Path):
            self._listener = await asyncio.start_unix_server(self._handle, sock=bind_unix_socket(
                address, mode=0o660, group=socket_group, backlog=64,
                in_use_hint="choose another metrics.listen or stop it."))
            self._socket_path = address
            bound = str(address)
        else:
            host, port = address
            self._listener = await asyncio.start_server(self._handle, host, port)
            name = self._listener.sockets[0].getsockname()
            bound = f"[{name[0]}]:{name[1]}" if ":" in name[0] else f"{name[0]}:{name[1]}"
        log.info("metrics_listening", address=bound)
        return bound

    async def close(self) -> None:
        if self._listener is None:
            return
        self._listener.close()
        self._listener = None
        if self._socket_path is not None:
            self._socket_path.unlink(missing_ok=True)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            status, body, content_type = self._respond(head)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode() + body
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass  # a scraper that went away or never finished its request: nothing to answer
        except Exception:
            log.exception("metrics_request_failed")
        finally:
            writer.close()

    def _respond(self, head: bytes) -> tuple[str, bytes, str]:
        if len(head) > _MAX_REQUEST_HEAD:
            return "431 Request Header Fields Too Large", b"request head too large\n", "text/plain"
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        if len(parts) != 3:
            return "400 Bad Request", b"malformed request line\n", "text/plain"
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method != "GET":
            return "405 Method Not Allowed", b"only GET /metrics\n", "text/plain"
        if target not in ("/metrics", "/"):
            return "404 Not Found", b"metrics are at /metrics\n", "text/plain"
        accept = next((line.split(":", 1)[1].strip() for line in lines[1:] if line.lower().startswith("accept:")), "")
        body, content_type = self.render(accept)
        return "200 OK", body, content_type
