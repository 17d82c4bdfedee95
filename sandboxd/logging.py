"""structlog setup: the one redaction step every event passes through, and the log's budgets.

Secrets reach logs two ways: under a key that names them (``env``, ``token``,
...), or as a value inside some other string (a tool echoing its token to
stderr). ``redact`` handles both: it masks sensitive keys, and replaces every
value registered with ``secret_values`` for the current task (a call's env
values and sensitive arguments) wherever it appears in the event. Code that logs
for a call outside its task (its sandbox's output) is handed the values and masks
them with ``masking``.

The log is shared by every user, and a sandbox or a client can cause lines at the
rate it likes (refused egress, crashes, calls, reconnects). Such a line names whose it
is (``budget=source(...)``); each source has a token bucket of lines (``log_rate`` a
second, ``log_burst`` at once), what is over it is dropped before it costs any
rendering, and one ``log_lines_dropped`` line per interval says what was dropped, by
whom. The metrics count every event regardless.

A person at a terminal gets console lines (colours unless ``NO_COLOR``); the service and
a pipe get JSON lines (``log_format``). Console lines carry a sandbox's own text (its
stderr, its errors), so control characters are escaped there as JSON escapes them:
a tool must not drive the operator's terminal.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator, MutableMapping

import structlog

MASK = "***"
SENSITIVE_KEYS = frozenset({"env", "password", "secret", "token", "authorization", "api_key", "sensitive"})
# Short values would mask ordinary words ("1", "on"); they are masked only under a sensitive key.
_MIN_SECRET_LENGTH = 4
_secrets: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("sandboxd_secrets", default=frozenset())


@contextlib.contextmanager
def secret_values(values: Iterable[Any]) -> Iterator[frozenset[str]]:
    """Mask these values in every event logged by this task (and tasks it starts) until exit;
    yields those masked (long enough to be told from ordinary words) for ``masking`` elsewhere."""
    found = frozenset({str(v) for v in values if v is not None and len(str(v)) >= _MIN_SECRET_LENGTH})
    token = _secrets.set(_secrets.get() | found)
    try:
        yield found
    finally:
        _secrets.reset(token)


@contextlib.contextmanager
def masking(secrets: frozenset[str]) -> Iterator[None]:
    """Also mask these (already filtered) values until exit: for code that runs outside the
    call that owns them, such as a sandbox's output arriving in a transport callback."""
    token = _secrets.set(_secrets.get() | secrets)
    try:
        yield
    finally:
        _secrets.reset(token)


def _scrub(value: Any, secrets: frozenset[str]) -> Any:
    if isinstance(value, str):
        for secret in secrets:
            if secret in value:
                value = value.replace(secret, MASK)
        return value
    if isinstance(value, dict):
        return {k: (_mask_all(v) if str(k).lower() in SENSITIVE_KEYS else _scrub(v, secrets)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_scrub(v, secrets) for v in value]
    return value


def _mask_all(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: MASK for k in value}
    return MASK


def redact(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    scrubbed: dict[str, Any] = _scrub(event, _secrets.get())
    return scrubbed


# -- the log's budgets ---------------------------------------------------------------

BUDGET_KEY = "budget"  # the event's source, as source() makes it; removed before rendering
SUMMARY_INTERVAL_S = 10.0
_SUMMARY_TOP = 10  # sources named in a summary line; the rest are counted in its total
_MAX_SOURCES = 10_000  # buckets kept; beyond, the full ones are forgotten first


def source(kind: str, who: Any) -> tuple[str, str]:
    """Whose budget a line is spent from: ``("sandbox", id)``, ``("user", name)``, ``("peer", uid)``, ..."""
    return kind, str(who)


class LogBudget:
    """A token bucket of log lines per source, one for all sources together, and the count of what was dropped.

    The shared bucket (``TOTAL_SOURCES`` sources' worth) bounds the log when a client names
    endless sources of its own making (made-up users, say); the per-source ones keep one
    noisy source from using it all."""

    TOTAL_SOURCES = 10

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst = rate, burst
        self._clock = clock
        self._buckets: dict[tuple[str, str], list[float]] = {}  # source → [tokens, when]
        self._total = [burst * self.TOTAL_SOURCES, clock()]
        self._dropped: defaultdict[tuple[str, str, str], int] = defaultdict(int)  # (kind, who, event) → lines dropped
        self.dropped_by_kind: defaultdict[str, int] = defaultdict(int)  # since start, for the metrics
        self._since = clock()

    def admit(self, kind_who: tuple[str, str], event: str) -> bool:
        now = self._clock()
        bucket = self._buckets.get(kind_who)
        if bucket is None:
            if len(self._buckets) >= _MAX_SOURCES:
                self._forget_full(now)
            bucket = self._buckets[kind_who] = [self.burst, now]
        if _take(bucket, now, self.rate, self.burst) and \
                _take(self._total, now, self.rate * self.TOTAL_SOURCES, self.burst * self.TOTAL_SOURCES):
            return True
        kind, who = kind_who
        self._dropped[kind, who, event] += 1
        self.dropped_by_kind[kind] += 1
        return False

    def summary(self) -> dict[str, Any] | None:
        """What was dropped since the last summary (then forgotten), or None if nothing was."""
        now = self._clock()
        self._forget_full(now)
        if not self._dropped:
            self._since = now
            return None
        ranked = sorted(self._dropped.items(), key=lambda item: -item[1])
        out = {"dropped": sum(self._dropped.values()), "interval_s": round(now - self._since, 1),
               "by_source": [{"source": kind, "who": who, "event": event, "dropped": n}
                             for (kind, who, event), n in ranked[:_SUMMARY_TOP]],
               "sources": len({(kind, who) for kind, who, _ in self._dropped}),
               "limits": {"log_rate": self.rate, "log_burst": self.burst}}
        self._dropped.clear()
        self._since = now
        return out

    def _forget_full(self, now: float) -> None:
        """A bucket that has refilled is the same as a new one: drop it, so that the sources kept are the busy ones."""
        for kind_who, (tokens, at) in list(self._buckets.items()):
            if tokens + (now - at) * self.rate >= self.burst:
                del self._buckets[kind_who]


def _take(bucket: list[float], now: float, rate: float, burst: float) -> bool:
    """One token from ``bucket`` ([tokens, when]) refilled at ``rate`` up to ``burst``; False if there is none."""
    tokens = min(burst, bucket[0] + (now - bucket[1]) * rate)
    bucket[1] = now
    if tokens >= 1:
        bucket[0] = tokens - 1
        return True
    bucket[0] = tokens
    return False


_budget = LogBudget(rate=10, burst=100)


def lines_dropped() -> dict[str, int]:
    """Log lines the budgets dropped since start, by source kind (sandbox, user, peer, ...)."""
    return dict(_budget.dropped_by_kind)


def set_log_budget(rate: float, burst: float) -> None:
    """Each source's lines: ``rate`` a second, ``burst`` at once (config log_rate, log_burst; live on reload)."""
    _budget.rate, _budget.burst = rate, burst


def log_dropped_summary() -> None:
    """Say what the budgets dropped since the last time, in one line (called every SUMMARY_INTERVAL_S)."""
    summary = _budget.summary()
    if summary is not None:
        get_logger("sandboxd.logging").warning(
            "log_lines_dropped", **summary,
            hint="these sources logged faster than log_rate lines/s (log_burst at once); the metrics count every event")


def admitted(kind_who: tuple[str, str], event: str) -> bool:
    """Whether the budget of ``kind_who`` admits one more ``event`` line (a drop is counted as within_budget
    counts it). For a hot path: build the line only when admitted, and log it then without ``budget=``."""
    return _budget.admit(kind_who, event)


def within_budget(_logger: Any, name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """First in the chain: a line over its source's budget is dropped before any other work."""
    kind_who = event.pop(BUDGET_KEY, None)
    if kind_who is not None and not _budget.admit(kind_who, str(event.get("event"))):
        raise structlog.DropEvent
    return event


class _Shown:
    """A string the console renderer prints as ``repr()`` has it: quoted, each unprintable character escaped."""

    __slots__ = ("_text",)

    def __init__(self, value: str) -> None:
        self._text = repr(value)

    def __repr__(self) -> str:
        return self._text


def _escape_lines(text: str) -> str:
    """The event and a traceback are printed as they are: escape what a terminal acts on, keep their lines."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch in "\n\t" else repr(ch)[1:-1] for ch in text)


def escape_controls(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Console output only: no control character (ESC, BEL, C1 CSI, bidi overrides, ...) reaches the terminal raw.

    The renderer prints a plain string value as it is; one with such characters is shown as repr() shows
    it. Containers are rendered with repr() already."""
    for key, value in event.items():
        if not isinstance(value, str) or value.isprintable():
            continue
        event[key] = _escape_lines(value) if key in ("event", "exception") else _Shown(value)
    return event


def _wants_colours(tty: bool) -> bool:
    """Colour for a person at a terminal that can show it, unless they opted out (https://no-color.org)."""
    return tty and not os.environ.get("NO_COLOR") and os.environ.get("TERM", "") != "dumb"


def configure_logging(level: str = "info", fmt: str = "auto", stream: Any = None) -> None:
    """``fmt``: ``console`` (lines for a person), ``json`` (lines for journald and tools), or ``auto``:
    console when ``stream`` (stderr by default) is a terminal, JSON otherwise."""
    stream = stream or sys.stderr
    isatty = getattr(stream, "isatty", None)
    tty = bool(isatty is not None and isatty())
    if fmt == "auto":
        fmt = "console" if tty else "json"
    rendering: list[Any] = (
        [escape_controls, structlog.dev.ConsoleRenderer(colors=_wants_colours(tty))] if fmt == "console"
        else [structlog.processors.JSONRenderer()]  # json.dumps escapes control characters itself
    )
    structlog.configure(
        processors=[
            within_budget,  # first: a dropped line costs nothing more
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact,  # last before rendering, so nothing added earlier escapes it
            *rendering,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def set_log_level(level: str) -> None:
    """Change the lowest level logged, keeping the rest of the setup (on reload)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())))


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)
