"""structlog setup, with the one redaction step every event passes through.

Secrets reach logs two ways: under a key that names them (``env``, ``token``,
...), or as a value inside some other string (a tool echoing its token to
stderr). ``redact`` handles both: it masks sensitive keys, and replaces every
value registered with ``secret_values`` for the current task (a call's env
values and sensitive arguments) wherever it appears in the event.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
from typing import Any, Iterable, Iterator

import structlog

MASK = "***"
SENSITIVE_KEYS = frozenset({"env", "password", "secret", "token", "authorization", "api_key", "sensitive"})
# Short values would mask ordinary words ("1", "on"); they are masked only under a sensitive key.
_MIN_SECRET_LENGTH = 4
_secrets: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("sandboxd_secrets", default=frozenset())


@contextlib.contextmanager
def secret_values(values: Iterable[Any]) -> Iterator[None]:
    """Mask these values in every event logged by this task (and tasks it starts) until exit."""
    found = {str(v) for v in values if v is not None and len(str(v)) >= _MIN_SECRET_LENGTH}
    token = _secrets.set(_secrets.get() | found)
    try:
        yield
    finally:
        _secrets.reset(token)


def current_secrets() -> frozenset[str]:
    """The values masked in this task's events (those ``secret_values`` registered)."""
    return _secrets.get()


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


def redact(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    return _scrub(event, _secrets.get())  # type: ignore[return-value]


def configure_logging(level: str = "info", fmt: str = "auto", stream: Any = None) -> None:
    stream = stream or sys.stderr
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False) if fmt == "console" else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            redact,  # last before rendering, so nothing added earlier escapes it
            renderer,
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
