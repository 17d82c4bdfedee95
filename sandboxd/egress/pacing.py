"""Token buckets for a sandbox's egress: its bytes (within the proxy's shares) and its new connections."""

from __future__ import annotations

import time
from typing import Protocol

from sandboxd.config import EgressConfig


class Shares(Protocol):
    """What a sandbox's ``Share`` asks of the proxy (egress/proxy.py): its settings, the share now, who moves data."""

    config: EgressConfig

    def share(self, now: float) -> float: ...

    def moving(self, budget: object, now: float) -> None: ...


class Share:
    """One sandbox's egress bytes, both ways: a token bucket at ``egress.rate_bytes`` a second, and
    never more than an equal share of ``egress.total_rate_bytes`` among the sandboxes moving data
    now (the proxy's ``share``); one second's worth at once."""

    def __init__(self, proxy: Shares) -> None:
        self._proxy = proxy
        self._tokens = float(proxy.config.rate_bytes)
        self._at = time.monotonic()

    def _refill(self, now: float) -> float:
        rate = self._proxy.share(now)
        self._tokens = min(rate, self._tokens + (now - self._at) * rate)
        self._at = now
        return rate

    def available(self) -> float:
        self._refill(time.monotonic())
        return self._tokens

    def refill_time(self, size: float) -> float:
        rate = self._refill(time.monotonic())
        return max(0.0, (size - self._tokens) / rate)

    def spend(self, size: int) -> None:
        now = time.monotonic()
        self._refill(now)
        self._tokens -= size
        self._proxy.moving(self, now)


class Debt:
    """A token bucket that lends: ``take`` always takes one and says how long to wait to have paid it back
    (new egress connections: ``egress.connect_rate`` a second, a second's worth at once)."""

    def __init__(self) -> None:
        self._tokens: float | None = None
        self._at = time.monotonic()

    def take(self, rate: float) -> float:
        now = time.monotonic()
        tokens = rate if self._tokens is None else min(rate, self._tokens + (now - self._at) * rate)
        self._tokens, self._at = tokens - 1, now
        return 0.0 if self._tokens >= 0 else -self._tokens / rate

    def owe(self, count: float) -> None:
        """Spend ``count`` more on what was taken last: the next ``take`` waits for it too."""
        if self._tokens is not None:
            self._tokens -= count
