"""``ping`` and ``sandbox/status`` through the router: every host asked at once, each answer kept under its
name, and the hosts that did not answer within ``FLEET_TIMEOUT_S`` listed (docs/protocol.md, "Through the router").

One ask per method is on its way at a time, and the requests that arrive meanwhile share its answer:
a client pipelining thousands of pings costs each host one ping at a time, not thousands."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Iterable

from sandboxd import __version__
from sandboxd.config import Config
from sandboxd.errors import SandboxdError
from sandboxd.router.forward import Hosts
from sandboxd.router.routing import Directory

FLEET_TIMEOUT_S = 2.0
EMPTY_TOTALS = {"starting": 0, "idle": 0, "busy": 0, "stopping": 0, "waiting": 0}  # when no host answered


async def ask_all(method: str, view: Directory, hosts: Hosts) -> tuple[dict[str, Any], list[str]]:
    """(node → (result, ms)) of the hosts that answered ``method`` in time, and the names of those that did not."""
    registered = [host for host in view.nodes().values() if host.address is not None]

    async def ask(node: str, address: str | None) -> tuple[Any, float]:
        assert address is not None
        started = time.monotonic()
        answer = await hosts.get(node, address).call(method, None, timeout_s=FLEET_TIMEOUT_S)
        assert isinstance(answer, dict), "asked without verbatim: parsed"
        return answer.get("result"), (time.monotonic() - started) * 1000

    results = await asyncio.gather(*(ask(host.name, host.address) for host in registered), return_exceptions=True)
    answered: dict[str, Any] = {}
    silent: list[str] = []
    for host, result in zip(registered, results):
        if isinstance(result, (SandboxdError, asyncio.TimeoutError)):
            silent.append(host.name)
        elif isinstance(result, BaseException):
            raise result
        elif result[0] is None:
            silent.append(host.name)  # an error answer
        else:
            answered[host.name] = result
    return answered, sorted(silent)


class Asking:
    """The fleet-wide asks on their way, by method."""

    def __init__(self, view: Directory, hosts: Hosts) -> None:
        self.view, self.hosts = view, hosts
        self._on_way: dict[str, asyncio.Future[tuple[dict[str, Any], list[str]]]] = {}

    async def ask(self, method: str) -> tuple[dict[str, Any], list[str]]:
        asked = self._on_way.get(method)
        if asked is None:
            asked = self._on_way[method] = asyncio.ensure_future(ask_all(method, self.view, self.hosts))
            asked.add_done_callback(lambda _done: self._on_way.pop(method, None))
        return await asyncio.shield(asked)  # one caller that leaves does not cancel the others' answer


async def ping(asking: Asking) -> dict[str, Any]:
    answered, silent = await asking.ask("ping")
    return {"hosts": {node: {"ms": round(ms, 2)} for node, (_, ms) in sorted(answered.items())}, "unanswered": silent}


async def status(config: Config, asking: Asking, *, connections: int, in_flight: int,
                 started_at: float) -> dict[str, Any]:
    """A daemon's status for the whole fleet, so clients that read one (``pool.users``, ``limits.allowedEnv``)
    read this alike: the hosts' pools and call counts summed (a user is on one host), their limits (one
    configuration fleet-wide); beside it, the router's own figures and every host's status by name."""
    view = asking.view
    answered, silent = await asking.ask("sandbox/status")
    states = {name: host.state for name, host in view.nodes().items()}
    by_host = {node: result for node, (result, _) in sorted(answered.items())}
    first: dict[str, Any] = next(iter(by_host.values()), {})
    return {
        "version": __version__,
        "protocol": 1,
        "router": True,
        "backend": first.get("backend"),
        "transport": first.get("transport"),
        "uptimeS": round(time.monotonic() - started_at, 1),
        "stopping": False,
        "connections": connections,
        "callsInFlight": in_flight,
        "calls": _summed(host.get("calls", {}) for host in by_host.values()),
        "pool": {"totals": _summed([EMPTY_TOTALS, *(host.get("pool", {}).get("totals", {}) for host in by_host.values())]),
                 "users": {user: row for host in by_host.values() for user, row in host.get("pool", {}).get("users", {}).items()},
                 "counters": _summed(host.get("pool", {}).get("counters", {}) for host in by_host.values())},
        "limits": first.get("limits") or _own_limits(config),
        "hosts": {node: {"state": states.get(node), **result} for node, result in by_host.items()},
        "unanswered": silent + sorted(name for name, host in view.nodes().items() if host.address is None),
    }


def _own_limits(config: Config) -> dict[str, Any]:
    """The limits of the router's own configuration, when no host answered (a daemon's shape, server/server.py)."""
    pool, calls = config.pool, config.calls
    return {"maxPerUser": pool.max_per_user, "maxTotal": pool.max_total, "minIdle": pool.min_idle,
            "idleTtlS": pool.idle_ttl_s, "defaultTimeoutMs": calls.default_timeout_ms,
            "maxTimeoutMs": calls.max_timeout_ms, "allowedEnv": list(calls.allowed_env)}


def _summed(tables: Iterable[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for table in tables:
        for key, value in table.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                total[key] = total.get(key, 0) + value
    return total
