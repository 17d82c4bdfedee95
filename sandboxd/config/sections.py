"""The sections the daemon's own behaviour reads: calls, pool, sandbox, egress, integrations, tools, metrics."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from sandboxd.hostport import parse_host_port
from sandboxd.config.defaults import AUTO_SANDBOX_ID, BRIDGE_NETWORK, DEFAULT_ALLOWED_ENV, DEFAULT_EMAIL_DB, DEFAULT_NETWORK, RUNNER_IMAGE
from sandboxd.rules.browser_relay import BrowserRelay
from sandboxd.rules.policy import AllowEntry
from sandboxd.rules.secrets import parse_secret_hosts


class Section(BaseModel):
    """A section of the configuration (calls, pool, ...): unknown keys are errors, assignments checked."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CallsConfig(Section):
    default_timeout_ms: int = Field(30_000, gt=0, description="Deadline of a call that names none.")
    max_timeout_ms: int = Field(600_000, gt=0, description="Cap on a call's timeoutMs.")
    cancel_grace_ms: int = Field(2_000, ge=0, description="How long a cancelled tool may take to settle before its sandbox is killed.")
    max_result_bytes: int = Field(1 << 20, ge=1024, description="A result larger than this is cut, with a note saying so.")
    allowed_env: list[str] = Field(default_factory=lambda: list(DEFAULT_ALLOWED_ENV), description="Env names a call may set.")
    # 100,000 lets a tool report every 10 ms for the longest deadline (10 min = 60,000 updates).
    max_progress_updates: int = Field(100_000, ge=1, description="Progress updates one call may send; past it the call is crashed and its sandbox replaced.")
    # Progress is status text: 64 MiB is 60,000 updates of 1 KiB with room to spare.
    max_progress_bytes: int = Field(64 << 20, ge=1024, description="Bytes of progress content one call may send; past it the call is crashed and its sandbox replaced.")
    output_rate_bytes: int = Field(1 << 20, ge=1024, description="Bytes per second of tool output (stderr, stdout) a sandbox may write; faster writers are slowed down.")
    output_burst_bytes: int = Field(4 << 20, ge=1024, description="Tool output a sandbox may write at once before output_rate_bytes applies.")
    # Well above what the pipes and sockets between a tool and the daemon hold (672 KiB
    # measured), which may still arrive after the call's answer.
    idle_output_bytes: int = Field(4 << 20, ge=4096, description="Tool output a sandbox may write while no call runs; past it the sandbox is replaced.")


class PoolConfig(Section):
    max_per_user: int = Field(4, ge=1, description="Sandboxes one user may hold at once.")
    max_total: int = Field(32, ge=1, description="Sandboxes the daemon may hold at once.")
    min_idle: int = Field(1, ge=0, description="Warm sandboxes kept for a user after their first call.")
    idle_ttl_s: float = Field(300.0, gt=0, description="A user idle this long loses their warm sandboxes.")
    # Each replacement costs ~0.15 s of CPU (node, esbuild, docker create/start): at 500 a
    # busy daemon spent most of a core on them (CHANGELOG.md, 2026-12-01).
    max_calls_per_sandbox: int = Field(10_000, ge=1, description="A sandbox is recycled after this many calls.")
    # Lambda's unreserved-concurrency floor, for users: while others hold the rest of the pool, a
    # user with nothing running still finds a slot at once (docs/design.md, "Sharing the pool").
    reserve: int | None = Field(None, ge=0, description="Sandboxes of max_total that only a user's first call may take, so that a user with nothing running is served while others hold the rest; null = max_total // 8 (4 of 32).")
    acquire_timeout_ms: int = Field(10_000, gt=0, description="How long a call may queue for a sandbox (then -32001).")
    start_timeout_ms: int = Field(30_000, gt=0, description="How long a sandbox may take to start and say ready.")
    shutdown_grace_s: float = Field(10.0, ge=0, description="How long calls in flight may finish at shutdown.")

    @model_validator(mode="after")
    def _reserve_below_total(self) -> PoolConfig:
        if self.reserve is not None and self.reserve >= self.max_total:
            raise ValueError(f"reserve ({self.reserve}) must be below max_total ({self.max_total}): the reserve is "
                             "the part of the pool kept for users' first calls, and calls beyond a user's first need "
                             "the rest; lower pool.reserve or raise pool.max_total")
        return self

    @property
    def reserved(self) -> int:
        """The slots only a user's first call may take: ``reserve``, or max_total // 8 when unset."""
        return self.reserve if self.reserve is not None else self.max_total // 8


class SandboxConfig(Section):
    image: str = Field(RUNNER_IMAGE, description="Runner image (make image builds it).")
    network: str = Field(DEFAULT_NETWORK, description=f"Docker network: none (the default: no route of its own; traffic goes through the egress proxy), {BRIDGE_NETWORK} (the daemon's own bridge: direct routes, no traffic between sandboxes), or another network or mode (allow_unsafe).")
    memory: str = Field("256m", description="Memory limit (docker syntax); swap is disabled.")
    cpus: float = Field(1.0, gt=0, description="CPU limit in cores.")
    pids_limit: int = Field(128, ge=8, description="Most processes and threads a sandbox may have.")
    tmp_size: str = Field("64m", description="Size of the tmpfs on /tmp.")
    read_only_root: bool = Field(True, description="Mount the image's filesystem read-only.")
    user: str = Field("auto", pattern=r"^(auto|\d+:\d+)$",
                      description=f"uid:gid the tool runs as; auto = {AUTO_SANDBOX_ID}:{AUTO_SANDBOX_ID}, an id with no account on the host.")
    runtime: str | None = Field(None, description="OCI runtime: runsc for gVisor (make gvisor registers it; docs/install.md, gVisor). Start-up stops when the engine lacks it or its flags.")
    cap_add: list[str] = Field(default_factory=list, description="Capabilities given back after dropping ALL.")
    no_new_privileges: bool = Field(True, description="Forbid gaining privileges through setuid binaries.")
    init: bool = Field(True, description="Run an init process as PID 1 that reaps zombies.")
    email_db: str = Field(DEFAULT_EMAIL_DB, description="Host path of the user's email database, named emails.db in a folder of that user's own; the folder is mounted at /officer/data. Never inside a user's data folder.")
    docker_host: str | None = Field(None, description="Docker engine URL; default DOCKER_HOST or the local socket.")
    transport: Literal["socket", "attach"] = Field(
        "socket",
        description="How the daemon talks to a sandbox's shim: socket = a unix socket bind-mounted into the sandbox "
                    "(fast; needs an engine on this host); attach = the container's stdin/stdout over docker attach "
                    "(works with a remote engine).",
    )

    @field_validator("user", mode="before")
    @classmethod
    def _quoted(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            # YAML 1.1 reads 1000:1000 as a base-60 number.
            raise ValueError("an unquoted uid:gid is read by YAML as a number; quote it, e.g. user: '2000000000:2000000000'")
        return value

    @field_validator("user", mode="after")
    @classmethod
    def _never_root(cls, value: str) -> str:
        if value != "auto" and 0 in (int(part) for part in value.split(":")):
            # No override: root in the sandbox is one kernel bug away from root on the host.
            raise ValueError(f"{value!r} runs tools as root (uid or gid 0), which is never allowed; "
                             "use auto (an id with no host account) or another uid:gid")
        return value

    @model_validator(mode="after")
    def _socket_needs_a_local_engine(self) -> SandboxConfig:
        if self.transport == "socket" and self.docker_host and not self.docker_host.startswith("unix://"):
            raise ValueError(
                f"transport 'socket' needs a Docker engine on this host, and docker_host is {self.docker_host}; "
                "set sandbox.transport: attach for a remote engine"
            )
        return self


def shim_line_bytes(calls: CallsConfig) -> int:
    """The longest line a shim may send: a result of calls.max_result_bytes, JSON-escaped, plus framing."""
    return calls.max_result_bytes * 2 + (64 << 10)


def parse_listen_address(value: str) -> tuple[str, int] | Path:
    """A metrics address: ``HOST:PORT`` on a loopback address (``[::1]:PORT`` for IPv6), or an absolute socket path."""
    if value.startswith("/"):
        return Path(value)
    address, port = parse_host_port(value, example="'127.0.0.1:9464', or an absolute socket path such as '/run/sandboxd/metrics.sock'",
                                    lowest_port=0)
    if not address.is_loopback:
        # Metrics describe users' activity; exporting them further is a proxy's job.
        raise ValueError(f"{address} is not a loopback address; metrics are served on 127.0.0.0/8 or ::1 only (or a unix socket)")
    return str(address), port


class EgressConfig(Section):
    policy: Literal["public", "allow-list", "none"] = Field(
        "public", description="Where sandboxes may connect, through the daemon's proxy: public = the public internet "
                              "(never loopback, private, link-local, metadata or the host's own addresses); "
                              "allow-list = only what egress.allow names; none = nowhere.")
    allow: list[str] = Field(default_factory=list, description="Destinations that pass even when private: host[:port], *.domain[:port], CIDR[:port] or [IPv6][:port]; without a port, the ports in egress.ports.")
    ports: list[int] = Field(default_factory=lambda: [80, 443], description="Ports sandboxes may connect to (HTTP, and HTTPS via CONNECT).")
    connect_timeout_ms: int = Field(10_000, gt=0, description="How long resolving a name and connecting to it may take.")
    idle_timeout_s: float = Field(300.0, gt=0, description="An egress connection with no traffic either way for this long is closed.")
    max_connections: int = Field(32, ge=1, description="Egress connections one sandbox may hold open at once.")
    # ~1 ms of the daemon's CPU per MiB moved (measured): 16 MiB/s is a few percent of a core per sandbox.
    rate_bytes: int = Field(16 << 20, ge=1 << 16, description="Bytes per second one sandbox may move through the egress proxy, both ways together; faster transfers are slowed down.")
    # The host's way out is shared: 128 MiB/s (~1 Gbit/s) is eight sandboxes at their full rate.
    total_rate_bytes: int | None = Field(128 << 20, ge=1 << 16, description="Bytes per second all sandboxes together may move through the egress proxy; each sandbox moving data gets an equal share of it (at most rate_bytes); null = no daemon-wide cap.")
    connect_rate: float = Field(50.0, gt=0, description="New egress connections a second one sandbox may open (a second's worth at once); more wait in the kernel's queue of egress.sock, then fail at once in the sandbox.")
    # A refusal is all cost (the daemon's answer is the only work done): a sandbox that is refused over
    # and over gets a fifth of the accepts of one whose connections go somewhere.
    refusal_cost: float = Field(5.0, ge=1, description="What an egress connection the proxy refuses (by the policy, as malformed, or over max_connections) spends of connect_rate, in connections: at 5, a sandbox refused every time opens 10 a second at the default rate, one whose connections pass 50.")
    secrets: dict[str, list[str]] = Field(default_factory=dict, description="Call env names whose values sandboxes never hold: NAME → the hosts the value belongs to (entries as egress.allow writes them). The sandbox gets a stand-in; the egress proxy puts the real value in the headers and query of requests to those hosts only, over TLS only (an entry written http://host:port also in clear: allow_unsafe secrets_in_clear).")
    ca_file: Path | None = Field(None, description="A PEM file of CA certificates the egress proxy trusts besides the host's own, when it makes the TLS connection to a secret's host itself.")

    @field_validator("allow", mode="after")
    @classmethod
    def _entries(cls, value: list[str]) -> list[str]:
        for item in value:
            AllowEntry.parse(item)  # ValueError naming the entry
        return value

    @field_validator("secrets", mode="after")
    @classmethod
    def _secret_hosts(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, hosts in value.items():
            parse_secret_hosts(name, hosts)  # ValueError naming the secret and the entry
        return value

    @field_validator("ca_file", mode="after")
    @classmethod
    def _readable_ca_file(cls, value: Path | None) -> Path | None:
        if value is not None:
            try:
                ssl.create_default_context(cafile=str(value))
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"{value} is not a readable PEM file of CA certificates ({exc})") from None
        return value

    @field_validator("ports", mode="after")
    @classmethod
    def _port_numbers(cls, value: list[int]) -> list[int]:
        for port in value:
            if not 0 < port < 65536:
                raise ValueError(f"{port} is not a port (1-65535)")
        return value


class IntegrationsConfig(Section):
    _relay: BrowserRelay | None = PrivateAttr(None)
    browser_relay: str | None = Field(None, description="Where the platform's browser relay listens, HOST:PORT or HOST:FIRST-LAST: a call whose OFFICER_BROWSER_RELAY_PORT is one of those ports reaches HOST:that port at 127.0.0.1 inside its sandbox; null = no relay.")

    @field_validator("browser_relay", mode="before")
    @classmethod
    def _host_and_port(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            # A bare port; or YAML 1.1 reading an unquoted host:port of digits as a base-60 number.
            raise ValueError(f"{value!r} is not HOST:PORT; name the relay's host too, and quote it, "
                             "e.g. '127.0.0.1:9222' or '127.0.0.1:9222-9230'")
        if isinstance(value, str):
            BrowserRelay.parse(value)  # ValueError naming the problem, under the key's name
        elif value is not None:  # e.g. YAML's mapping for an unquoted "127.0.0.1:"
            raise ValueError(f"{value!r} is not HOST:PORT or HOST:FIRST-LAST; quote it, "
                             "e.g. '127.0.0.1:9222' or '127.0.0.1:9222-9230'")
        return value

    @model_validator(mode="after")
    def _parsed(self) -> IntegrationsConfig:
        self._relay = BrowserRelay.parse(self.browser_relay) if self.browser_relay is not None else None
        return self

    @property
    def relay(self) -> BrowserRelay | None:
        """``browser_relay`` parsed (once, not at every call that reads it)."""
        return self._relay


class ToolsConfig(Section):
    require_permissions: bool = Field(False, description="A tool whose TOOL.md has no permissions block gets no network, no call env, no email database and no browser relay; off = such a tool gets what every tool of its sandbox gets.")


class MetricsConfig(Section):
    listen: str | None = Field(None, description="Where Prometheus metrics are served: HOST:PORT on loopback, or a unix socket path; null = off.")

    @field_validator("listen", mode="after")
    @classmethod
    def _loopback_or_path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_listen_address(value)
        return value
