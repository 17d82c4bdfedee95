"""The daemon's file descriptors, shared out like its other resources.

Every connection costs the daemon a descriptor, and it has RLIMIT_NOFILE of them: each
sandbox's egress tunnels (two each: the sandbox's end and the upstream one), each client's
connections to the API socket, and the daemon's own work (Docker's API, the listening
sockets, logs, metrics, DNS), and the egress relay's pipes (``RELAY_PIPES``, shared by every
tunnel). When they run out, accept() and socket() fail with EMFILE for every user at once.
So start-up divides the limit (``FdBudget``): a fixed reserve for the daemon's own work and
the relay's pipes, a share for each sandbox the pool may hold, and the rest for clients,
of which one peer uid may hold ``per_client`` (``ClientShares``). A configuration whose
shares do not fit the limit stops start-up. docs/config.md, "File descriptors".
"""

from __future__ import annotations

import collections
import resource
from dataclasses import dataclass
from typing import Callable

from sandboxd.config import Config
from sandboxd.errors import ConfigError
from sandboxd.logging import get_logger

log = get_logger("sandboxd.fds")

# The daemon's own work: ~20 descriptors idle (measured), plus the Docker SDK's pooled connections
# (10 at most), eight DNS threads' sockets, esbuild's pipes and metrics scrapes, with room to spare.
RESERVED_FDS = 256
# Pipes the egress relay may hold at once, every tunnel's together (egress/relay.py): a direction
# holds one while bytes wait for a slow reader; past them it waits in a buffer. Two descriptors each,
# at most 256 KiB of kernel memory each (8 MiB in all).
RELAY_PIPES = 32
RELAY_PIPE_FDS = 2 * RELAY_PIPES
# A sandbox's own, besides its egress tunnels: its egress.sock listener, the shim's connection,
# the attach stream, and a connect to Docker while it starts or stops (8 idle sandboxes: 35, measured).
SANDBOX_OWN_FDS = 4
# Egress connections past egress.max_connections a sandbox may have open while they are
# answered 503; past that the proxy accepts no more until one closes (the kernel queues them).
EGRESS_REFUSING = 4
# Connections past max_client_connections one uid may have open while they are answered
# with the refusal; past that they are closed unanswered at once.
CLIENT_REFUSING = 8
# The cluster listener's (cluster.listen), when there is one: its handshakes in progress and the connections
# of other hosts, routers and operators, apart from the unix socket's clients (server/tls_listener.py).
TLS_LISTENER_FDS = 256
# Below this, clients (pi-bridge sessions, `sandboxd mcp`, the CLI) would queue for a connection.
MIN_CLIENT_FDS = 64
# Each uid may hold a quarter of the clients' share: four uids at their cap fill it, one never does.
CLIENT_SHARE_DIVISOR = 4


def egress_fds(max_connections: int) -> int:
    """Descriptors one sandbox's egress may hold: two per tunnel, and its refusals in flight."""
    return 2 * max_connections + EGRESS_REFUSING


@dataclass(frozen=True)
class FdBudget:
    limit: int  # RLIMIT_NOFILE (soft) the daemon runs with
    reserved: int  # the daemon's own work
    per_sandbox: int  # one sandbox: its egress (egress_fds) and its own (SANDBOX_OWN_FDS)
    sandboxes: int  # pool.max_total of them
    clients: int  # every connection to the API socket together, refused ones included
    per_client: int  # connections one peer uid may hold (max_client_connections, or a share of clients)
    pipes: int = RELAY_PIPE_FDS  # the egress relay's pipes, every tunnel's together
    tls: int = 0  # the cluster listener's handshakes and connections (TLS_LISTENER_FDS when it listens)

    @classmethod
    def plan(cls, config: Config, limit: int) -> FdBudget:
        """Divide ``limit`` for ``config``; ConfigError names the keys and the fix when it does not fit."""
        egress = config.egress.max_connections
        per_sandbox = egress_fds(egress) + SANDBOX_OWN_FDS
        sandboxes = config.pool.max_total * per_sandbox
        tls = TLS_LISTENER_FDS if config.cluster is not None and config.cluster.listen is not None else 0
        clients = limit - RESERVED_FDS - RELAY_PIPE_FDS - sandboxes - tls
        if clients < MIN_CLIENT_FDS:
            need = RESERVED_FDS + RELAY_PIPE_FDS + tls + sandboxes + MIN_CLIENT_FDS
            raise ConfigError(
                f"the file descriptor limit ({limit}, RLIMIT_NOFILE) cannot hold this configuration: "
                f"pool.max_total ({config.pool.max_total}) sandboxes of {per_sandbox} descriptors each "
                f"(2 x egress.max_connections ({egress}) + {EGRESS_REFUSING + SANDBOX_OWN_FDS} of their own) "
                f"is {sandboxes}; with {RESERVED_FDS} for the daemon itself, {RELAY_PIPE_FDS} for the egress relay's "
                f"pipes, {tls} for the cluster listener and {MIN_CLIENT_FDS} for clients it needs {need}. Raise the limit to at least {need} "
                f"(LimitNOFILE= in the systemd unit, `ulimit -Hn` in a shell), or lower pool.max_total or "
                "egress.max_connections.")
        derived = (clients - CLIENT_REFUSING) // CLIENT_SHARE_DIVISOR
        per_client = config.max_client_connections or derived
        if per_client + CLIENT_REFUSING > clients:
            raise ConfigError(
                f"max_client_connections ({per_client}) does not fit the clients' share of the file descriptor "
                f"limit ({clients} of {limit}, after {sandboxes} for the sandboxes and "
                f"{RESERVED_FDS + RELAY_PIPE_FDS + tls} for the daemon, its relay's pipes and its cluster listener): "
                f"set it to at most "
                f"{clients - CLIENT_REFUSING} (or leave it unset: {derived}), or raise the limit (LimitNOFILE= in "
                "the systemd unit).")
        return cls(limit, RESERVED_FDS, per_sandbox, sandboxes, clients, per_client, RELAY_PIPE_FDS, tls)


def raise_nofile_limit() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one; (soft before, hard, soft now).

    Python's own users of descriptors (asyncio's epoll, subprocess) have no FD_SETSIZE
    ceiling, so the whole hard limit is usable. Under the shipped unit the raise is denied
    (it filters @resources): its LimitNOFILE= sets both limits instead."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        return soft, hard, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as exc:
        log.warning("fd_limit_not_raised", soft=soft, hard=hard, error=str(exc),
                    hint="set LimitNOFILE= in the systemd unit (or `ulimit -n` before starting the daemon)")
        return soft, hard, soft
    return soft, hard, resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class ClientShares:
    """The API socket's accepted connections by peer uid, against ``FdBudget.clients`` and ``per_client``.

    ``admit`` decides for each accepted connection: served, refused with an answer (past the
    uid's cap, while fewer than CLIENT_REFUSING of its refusals are open), or closed at once.
    A connection counts until it is closed, refused ones too (they linger for their answer).
    The server stops accepting while every client descriptor is in use (``full``) and starts
    again at ``when_room``, so the daemon itself never meets EMFILE: a newcomer waits in the
    socket's backlog instead."""

    def __init__(self, budget: FdBudget) -> None:
        self.budget = budget
        self.served: collections.Counter[int] = collections.Counter()  # uid → connections served
        self.refusing: collections.Counter[int] = collections.Counter()  # uid → refusals open for their answer
        self.total = 0
        self.when_room: Callable[[], None] | None = None  # called once, when the first descriptor is free again

    def admit(self, uid: int) -> str:
        """"serve", "refuse" or "drop" for a connection of ``uid`` just accepted (counted unless dropped)."""
        if self.served[uid] < self.budget.per_client:
            verdict, count = "serve", self.served
        elif self.refusing[uid] < CLIENT_REFUSING:
            verdict, count = "refuse", self.refusing
        else:
            return "drop"
        count[uid] += 1
        self.total += 1
        return verdict

    @property
    def full(self) -> bool:
        return self.total >= self.budget.clients

    def release(self, uid: int, verdict: str) -> None:
        """A connection ``admit`` counted is closed."""
        count = self.served if verdict == "serve" else self.refusing
        count[uid] -= 1
        if count[uid] <= 0:
            del count[uid]
        self.total -= 1
        if self.when_room is not None and not self.full:
            resume, self.when_room = self.when_room, None
            resume()

    def refusal(self, uid: int) -> str:
        return (f"uid {uid} already holds {self.budget.per_client} connections to sandboxd, its share of the "
                f"daemon's file descriptors (max_client_connections); close idle ones, or the operator can raise "
                f"max_client_connections or LimitNOFILE (limit now {self.budget.limit})")
