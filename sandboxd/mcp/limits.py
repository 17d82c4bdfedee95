"""What one `sandboxd mcp --http` process holds at most; its defaults are in docs/mcp.md ("Bounds")."""

from __future__ import annotations

import math
import resource
from dataclasses import dataclass

from sandboxd.errors import ConfigError

MIN_CONNECTIONS = 8
# Descriptors the process needs besides its HTTP connections: the listener, the daemon's
# socket, the event loop's, stdio, logs, a few the SDK and Python open.
FD_RESERVE = 64


@dataclass(frozen=True)
class HttpLimits:
    """What one `sandboxd mcp --http` process holds at most (docs/mcp.md, "Bounds")."""

    head_timeout_s: float = 5.0
    max_connections: int = 1024
    max_sessions: int = 64
    session_idle_s: float = 900.0

    def __post_init__(self) -> None:
        for name, value, low in (("--head-timeout", self.head_timeout_s, 0.1),
                                 ("--max-connections", self.max_connections, MIN_CONNECTIONS),
                                 ("--max-sessions", self.max_sessions, 1),
                                 ("--session-idle-timeout", self.session_idle_s, 1.0)):
            if not (math.isfinite(value) and value >= low):
                raise ConfigError(f"{name} {value} is out of range; give at least {low} (default: see "
                                  "`sandboxd mcp --help`).")


def connection_cap(wanted: int) -> int:
    """``wanted``, or fewer when the fd limit (raised to its hard limit first) cannot hold that many.

    ConfigError when the limit leaves room for fewer than MIN_CONNECTIONS.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # e.g. a seccomp filter: the soft limit it is
    room = soft - FD_RESERVE if soft != resource.RLIM_INFINITY else wanted
    if room < MIN_CONNECTIONS:
        raise ConfigError(f"the open-file limit ({soft}) leaves room for {max(room, 0)} HTTP connections; raise it "
                          f"(ulimit -n, or LimitNOFILE= in a unit) to at least {FD_RESERVE + MIN_CONNECTIONS}.")
    return min(wanted, room)
