"""One typed configuration, loaded from YAML, then SANDBOXD_* variables, then flags.

Precedence (last wins): defaults < YAML file < environment < command-line flags.
A key in a section is named ``SANDBOXD_<SECTION>_<KEY>`` in the environment,
e.g. ``SANDBOXD_POOL_MAX_PER_USER=8``. Unknown keys and bad values stop
start-up with the key's name. Every key is documented in docs/config.md.
"""

from __future__ import annotations

import grp
import ipaddress
import os
import pwd
import ssl
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from sandboxd import __version__
from sandboxd.egress.browser_relay import BrowserRelay
from sandboxd.egress.policy import AllowEntry
from sandboxd.egress.secrets import parse_secret_hosts
from sandboxd.errors import ConfigError, InvalidParams
from sandboxd.users import check_user

SYSTEM_CONFIG = Path("/etc/sandboxd/config.yaml")
REPO_ROOT = Path(__file__).resolve().parent.parent
RUNNER_IMAGE = f"sandboxd/node:{__version__}"  # tests check this matches images/node/VERSION

# Integration variables pi-bridge may pass per call (docs/tools.md, "The entry file").
DEFAULT_ALLOWED_ENV = [
    "OFFICER_RESOURCES",
    "PI_SEARXNG_URL",
    "OFFICER_APIFY_TOKEN",
    "OFFICER_BROWSER_RELAY_PORT",
    "OFFICER_BROWSER_RELAY_TOKEN",
]


# What `sandbox.user: auto` runs tools as: in the range systemd documents as unused
# (1879048192-2147483647), so it is no account on the host and owns nothing but sandbox data.
AUTO_SANDBOX_ID = 2_000_000_000
# Outside DATA_PATH/<user>/, which sandboxes can write: a sandbox could turn a database path
# in there into a link to another user's file, and Docker follows links (sandbox/mounts.py).
# Its folder is what a sandbox mounts (at /officer/data), so SQLite's -journal, -wal and -shm
# are the host's own files: one folder per user, and the file named as tools expect it.
DEFAULT_EMAIL_DB = "{data_path}/email/{user}/emails.db"
EMAIL_DB_NAME = "emails.db"


# Sandboxes have no network of their own (loopback only): their traffic leaves through the
# daemon's egress proxy, which applies `egress` (egress/). BRIDGE_NETWORK is the bridge the
# daemon makes for operators who accept direct routes (inter-container traffic off).
DEFAULT_NETWORK = "none"
BRIDGE_NETWORK = "sandboxd"

# Settings that weaken the sandbox start only when `allow_unsafe` names them (docs/config.md).
UnsafeName = Literal["host_network", "shared_network", "direct_network", "cap_add", "writable_root", "host_uid",
                     "unsandboxed", "mcp_http_remote"]
UNSAFE_NAMES: tuple[str, ...] = get_args(UnsafeName)


def default_socket_path() -> Path:
    """docs/protocol.md's default when we may create /run/sandboxd, else a per-user runtime dir."""
    if os.geteuid() == 0:
        return Path("/run/sandboxd/sandboxd.sock")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "sandboxd" / "sandboxd.sock"
    return Path(f"/tmp/sandboxd-{os.geteuid()}/sandboxd.sock")


def checkout() -> Path | None:
    """The source tree this sandboxd runs from (a clone with `make setup`), or None when it is installed."""
    if (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "seed" / "tools").is_dir():
        return REPO_ROOT
    return None


def default_data_path() -> Path:
    # In a checkout, every command (make serve's daemon, validate, run, tools list --disk) reads
    # the checkout's own data: one default, so they agree (docs/config.md, "Where the data is").
    tree = checkout()
    if tree is not None:
        return tree / ".sandboxd" / "data"
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "sandboxd"


def default_seed_tools() -> Path | None:
    tree = checkout()
    return tree / "seed" / "tools" if tree is not None else None


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class CallsConfig(_Section):
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


class PoolConfig(_Section):
    max_per_user: int = Field(4, ge=1, description="Sandboxes one user may hold at once.")
    max_total: int = Field(32, ge=1, description="Sandboxes the daemon may hold at once.")
    min_idle: int = Field(1, ge=0, description="Warm sandboxes kept for a user after their first call.")
    idle_ttl_s: float = Field(300.0, gt=0, description="A user idle this long loses their warm sandboxes.")
    # Each replacement costs ~0.15 s of CPU (node, esbuild, docker create/start): at 500 a
    # busy daemon spent most of a core on them (docs/performance.md).
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


class SandboxConfig(_Section):
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
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"{value!r} is neither HOST:PORT nor an absolute unix socket path; e.g. '127.0.0.1:9464' or '/run/sandboxd/metrics.sock'")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host == "localhost":
        host = "127.0.0.1"
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"{port_text!r} in {value!r} is not a port number (0-65535)")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address; metrics listen on loopback only, e.g. '127.0.0.1:9464'") from None
    if not address.is_loopback:
        # Metrics describe users' activity; exporting them further is a proxy's job.
        raise ValueError(f"{host} is not a loopback address; metrics are served on 127.0.0.0/8 or ::1 only (or a unix socket)")
    return str(address), int(port_text)


class EgressConfig(_Section):
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
    secrets: dict[str, list[str]] = Field(default_factory=dict, description="Call env names whose values sandboxes never hold: NAME → the hosts the value belongs to (entries as egress.allow writes them). The sandbox gets a stand-in; the egress proxy puts the real value in the headers and query of requests to those hosts only.")
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


class IntegrationsConfig(_Section):
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


class MetricsConfig(_Section):
    listen: str | None = Field(None, description="Where Prometheus metrics are served: HOST:PORT on loopback, or a unix socket path; null = off.")

    @field_validator("listen", mode="after")
    @classmethod
    def _loopback_or_path(cls, value: str | None) -> str | None:
        if value is not None:
            parse_listen_address(value)
        return value


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: Any) -> int:
    """A size in bytes: a whole number, or one with a binary unit like docker's (``512k``, ``20m``, ``5g``, ``1t``)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size; write a number of bytes or one with a unit, e.g. '5g' or '500m'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{value} is a negative size")
        return value
    if isinstance(value, str):
        text = value.strip().lower().removesuffix("ib").removesuffix("b")
        number, unit = (text[:-1], text[-1]) if text[-1:] in ("k", "m", "g", "t") else (text, "")
        if number.replace(".", "", 1).isdigit():
            return int(float(number) * _SIZE_UNITS[unit])
    raise ValueError(f"{value!r} is not a size; write a number of bytes or one with a unit k, m, g or t "
                     "(powers of 1024), e.g. '5g' or '500m'")


Enforcement = Literal["off", "soft", "hard", "auto"]


class UserQuota(_Section):
    quota_bytes: int | None = Field(None, description="This user's byte quota; null = storage.quota_bytes.")
    quota_inodes: int | None = Field(None, ge=1, description="This user's file count quota; null = storage.quota_inodes.")

    @field_validator("quota_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return None if value is None else parse_size(value)


class StorageConfig(_Section):
    # E2B gives a sandbox 1-5 GB, Daytona 3 GiB: the upper end, for a user's data and mail together.
    quota_bytes: int = Field(5 << 30, ge=1 << 20, description="Bytes one user's folders (DATA_PATH/<user> and the email folder) may hold together, as a size like '5g' or '500m'.")
    quota_inodes: int = Field(500_000, ge=100, description="Files and folders one user's folders may hold together.")
    enforcement: Enforcement = Field("auto", description="off = no quota; soft = usage measured after each call and on an interval, a user over quota is refused new calls; hard = the kernel stops writes at the limit (btrfs qgroups; start-up stops where it cannot); auto = hard where the filesystem allows it, else soft, said once at start.")
    measure_interval_s: float = Field(60.0, gt=0, description="How often each user's usage is measured besides after their calls (users over quota: every few seconds).")
    helper_socket: Path = Field(Path("/run/sandboxd-quota.sock"), description="The privileged quota helper's socket (sandboxd-quota.socket), used when the daemon does not run as root.")
    users: dict[str, UserQuota] = Field(default_factory=dict, description="Per-user quotas: user email -> {quota_bytes, quota_inodes}; what a user's entry leaves out is the default.")

    @field_validator("quota_bytes", mode="before")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return parse_size(value)

    @field_validator("enforcement", mode="before")
    @classmethod
    def _unquoted_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads an unquoted off as false

    @field_validator("users", mode="before")
    @classmethod
    def _user_names(cls, value: Any) -> Any:
        if isinstance(value, dict):
            checked = {}
            for name, limits in value.items():
                try:
                    checked[check_user(name)] = limits
                except InvalidParams as exc:
                    raise ValueError(f"storage.users: {exc.message}") from None
            return checked
        return value

    def limits(self, user: str) -> tuple[int, int]:
        """(bytes, inodes) ``user`` may hold."""
        own = self.users.get(user)
        if own is None:
            return self.quota_bytes, self.quota_inodes
        return (own.quota_bytes if own.quota_bytes is not None else self.quota_bytes,
                own.quota_inodes if own.quota_inodes is not None else self.quota_inodes)


def _resolve_ids(value: Any, lookup: Callable[[str], int], kind: str) -> Any:
    """A list of numeric ids or names (one bare item is a list of one) → numeric ids."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    ids = []
    for item in items:
        if isinstance(item, str) and not item.strip().isdigit():
            try:
                item = lookup(item.strip())
            except KeyError:
                raise ValueError(f"there is no {kind} named {item!r} on this host; give a numeric id or create the {kind}") from None
        ids.append(item)
    return ids


class Config(_Section):
    data_path: Path = Field(default_factory=default_data_path, description="Root of tools and user data.")
    seed_tools: Path | None = Field(default_factory=default_seed_tools, description="Seed tools synced into DATA_PATH/tools at start.")
    socket: Path = Field(default_factory=default_socket_path, description="Unix socket the daemon listens on.")
    socket_mode: int = Field(0o660, description="File mode of the socket (octal in YAML: '0660').")
    socket_group: str | None = Field(None, description="Group that owns the socket.")
    allowed_uids: list[int] = Field(default_factory=list, description="Users (uid or name) whose connections are served, besides root and the daemon's own user; both lists empty = anyone who can open the socket.")
    allowed_gids: list[int] = Field(default_factory=list, description="Groups (gid or name) whose members' connections are served (primary or supplementary group).")
    backend: Literal["docker", "process", "fake"] = Field("docker", description="Sandbox backend; process runs tools UNSANDBOXED (serve needs allow_unsafe: [unsandboxed]).")
    allow_unsafe: list[UnsafeName] = Field(default_factory=list, description="Dangerous settings accepted on purpose, by name: host_network, shared_network, direct_network, cap_add, writable_root, host_uid, unsandboxed, mcp_http_remote.")
    max_message_bytes: int = Field(16 << 20, ge=1024, description="Longest accepted protocol line.")
    max_client_connections: int | None = Field(None, ge=1, description="Connections to the socket one client (one peer uid) may hold at once; past it a newcomer is refused (-32003). null = a quarter of what the file descriptor budget leaves for clients (docs/config.md, 'File descriptors').")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Lowest level logged.")
    log_format: Literal["auto", "json", "console"] = Field("auto", description="auto: console on a terminal, JSON lines otherwise.")
    # A refused-connection flood from four sandboxes for 10 s: 4 x (100 + 10 x 10) lines, ~250 KB.
    log_rate: float = Field(10.0, gt=0, description="Log lines a second that one source (a sandbox, a user's calls, a client's uid) may cause; past log_burst, more are dropped and counted in one log_lines_dropped line per 10 s.")
    log_burst: int = Field(100, ge=1, description="Log lines one source may cause at once before log_rate applies.")
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field("auto", description="The daemon's event loop: uvloop (~15% less daemon CPU per call), Python's asyncio, or auto (uvloop when installed).")
    calls: CallsConfig = Field(default_factory=CallsConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    egress: EgressConfig = Field(default_factory=EgressConfig)
    integrations: IntegrationsConfig = Field(default_factory=IntegrationsConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)

    @field_validator("allowed_uids", mode="before")
    @classmethod
    def _uids(cls, value: Any) -> Any:
        return _resolve_ids(value, lambda name: pwd.getpwnam(name).pw_uid, "user")

    @field_validator("allowed_gids", mode="before")
    @classmethod
    def _gids(cls, value: Any) -> Any:
        return _resolve_ids(value, lambda name: grp.getgrnam(name).gr_gid, "group")

    @field_validator("allow_unsafe", mode="before")
    @classmethod
    def _override_names(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list):
            for item in items:
                if item not in UNSAFE_NAMES:
                    raise ValueError(f"{item!r} is not an override name; the names are {', '.join(UNSAFE_NAMES)} "
                                     "(docs/config.md, allow_unsafe)")
        return items

    @model_validator(mode="after")
    def _dangerous_settings_are_named(self) -> Config:
        refused = [message for name, message in unsafe_settings(self)
                   if name not in self.allow_unsafe and name != "unsandboxed"]  # serve checks that one
        if refused:
            raise ValueError("; ".join(refused))
        return self

    @field_validator("socket_mode", mode="before")
    @classmethod
    def _octal(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return int(value, 8)
            except ValueError:
                raise ValueError(f"{value!r} is not an octal file mode like '0660'") from None
        return value

    @field_validator("data_path", "socket", "seed_tools", mode="after")
    @classmethod
    def _absolute(cls, value: Path | None) -> Path | None:
        return value.expanduser().absolute() if value is not None else None

    @model_validator(mode="after")
    def _secrets_are_call_env(self) -> Config:
        for name in self.egress.secrets:
            if name not in self.calls.allowed_env:
                raise ValueError(f"egress.secrets names {name}, which calls.allowed_env does not list: a call could "
                                 f"never set it; add {name} to calls.allowed_env or remove it from egress.secrets")
        return self

    @model_validator(mode="after")
    def _email_db_outside_user_data(self) -> Config:
        email_db_path(self, "probe@example.invalid")  # raises ValueError naming the problem
        return self


def email_db_path(config: Config, user: str) -> Path:
    """The host path of ``user``'s email database, from the ``sandbox.email_db`` template.

    ValueError if the template is unusable: it must name ``{user}`` (one database per
    user) and lie outside every user's data folder (DATA_PATH/<something with @>/), which
    that user's sandboxes can write.
    """
    template = config.sandbox.email_db
    if "{user}" not in template:
        raise ValueError(f"sandbox.email_db {template!r} must contain {{user}}: each user has a database of their own")
    path = _email_db_for(template, config.data_path, user)
    if not path.is_absolute():
        raise ValueError(f"sandbox.email_db {template!r} must be an absolute path (or start with {{data_path}})")
    if path.name != EMAIL_DB_NAME:
        raise ValueError(f"sandbox.email_db {template!r} must name a file {EMAIL_DB_NAME!r}: its folder is mounted at "
                         f"/officer/data, where tools open /officer/data/{EMAIL_DB_NAME} (docs/tools.md); "
                         f"e.g. {DEFAULT_EMAIL_DB!r}")
    # Two users' folders must differ: a sandbox mounts the whole folder, read-write.
    if _email_db_for(template, config.data_path, "other-" + user).parent == path.parent:
        raise ValueError(f"sandbox.email_db {template!r} must put {{user}} in the folder's name, not only the file's: "
                         f"each user's sandboxes mount the database's folder, so every user needs one of their own; "
                         f"e.g. {DEFAULT_EMAIL_DB!r}")
    data_path = Path(os.path.normpath(config.data_path))
    if path.is_relative_to(data_path) and path != data_path:
        first = path.relative_to(data_path).parts[0]
        if "@" in first:
            raise ValueError(
                f"sandbox.email_db {template!r} lies inside a user's data folder, which that user's sandboxes can "
                f"write (and so turn into a link to another user's file); use the default {DEFAULT_EMAIL_DB!r}"
            )
        if first in ("tools", ".cache"):
            raise ValueError(f"sandbox.email_db {template!r} lies inside DATA_PATH/{first}, which every user's "
                             f"sandboxes mount; use the default {DEFAULT_EMAIL_DB!r}")
    return path


def _email_db_for(template: str, data_path: Path, user: str) -> Path:
    try:
        return Path(os.path.normpath(template.format(data_path=data_path, user=user)))
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"sandbox.email_db {template!r} may use only {{data_path}} and {{user}} ({exc})") from None


def unsafe_settings(config: Config) -> list[tuple[str, str]]:
    """(override name, what it risks and how to accept it) for each dangerous setting in ``config``."""
    found = []

    def add(name: str, risk: str) -> None:
        found.append((name, f"{risk}; set allow_unsafe: [{name}] to accept it"))

    sandbox = config.sandbox
    network = sandbox.network
    if network == "host" or network.startswith("container:"):
        add("host_network", f"sandbox.network {network!r} gives tools the network of the host (or of that "
                            "container), with every service listening on its loopback")
    elif network == BRIDGE_NETWORK:
        add("direct_network", f"sandbox.network {network!r} gives sandboxes a route of their own, around the egress "
                              "policy (to the host, the private network, the metadata endpoint); the default 'none' "
                              "sends all traffic through the egress proxy")
    elif network != "none":
        add("shared_network", f"sandbox.network {network!r} lets sandboxes of different users (and other "
                              f"containers) reach each other, around the egress policy; the default 'none' does not")
    if sandbox.cap_add:
        add("cap_add", f"sandbox.cap_add [{', '.join(sandbox.cap_add)}] gives tools back capabilities every sandbox drops")
    if not sandbox.read_only_root:
        add("writable_root", "sandbox.read_only_root false lets a tool change the image's files (node, the shim) "
                             "under every later call in that sandbox")
    if sandbox.user != "auto":
        uid = int(sandbox.user.split(":")[0])
        if uid == os.geteuid():
            add("host_uid", f"sandbox.user {sandbox.user!r} runs tools as the daemon's own uid, owner of its "
                            "files and sockets; use auto, an id with no host account")
        else:
            try:
                account: str | None = pwd.getpwuid(uid).pw_name
            except KeyError:
                account = None
            if account is not None:
                add("host_uid", f"sandbox.user {sandbox.user!r} runs tools as the host account {account!r}, "
                                "whose files they could then change; use auto, an id with no host account")
    if config.backend == "process":
        add("unsandboxed", "backend 'process' runs tools as local node processes with this daemon's rights, "
                           "files and network: nothing isolates them (development only)")
    return found


def check_unsandboxed(config: Config) -> None:
    """For ``serve``: the process backend only when ``allow_unsafe`` names it (``sandboxd run`` asks by flag)."""
    for name, message in unsafe_settings(config):
        if name == "unsandboxed" and name not in config.allow_unsafe:
            raise ConfigError(f"invalid configuration: {message}")


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """SANDBOXD_<KEY> and SANDBOXD_<SECTION>_<KEY> → a nested dict; unknown names are errors."""
    names: dict[str, tuple[str, ...]] = {}
    for key, field in Config.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, _Section):
            for sub in annotation.model_fields:
                names[f"SANDBOXD_{key}_{sub}".upper()] = (key, sub)
        else:
            names[f"SANDBOXD_{key}".upper()] = (key,)
    out: dict[str, Any] = {}
    for env_name, raw in environ.items():
        if not env_name.startswith("SANDBOXD_"):
            continue
        path = names.get(env_name)
        if path is None:
            # SANDBOXD_CONFIG names the file itself, SANDBOXD_MCP_TOKEN is `sandboxd mcp --http`'s
            # secret (never a config key: it must not sit in a file); everything else must be a key.
            if env_name in ("SANDBOXD_CONFIG", "SANDBOXD_MCP_TOKEN"):
                continue
            raise ConfigError(f"{env_name} is not a configuration key; see docs/config.md for the names.")
        # YAML parsing gives lists, numbers and booleans their natural spelling;
        # what is not YAML at all (e.g. "[::1]:9464") is meant as a plain string.
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        target = out
        for part in path[:-1]:
            target = target.setdefault(part, {})
        target[path[-1]] = value
    return out


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe(error: ValidationError, source: str) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key (see docs/config.md for the keys)")
        else:
            message = str(item["msg"]).removeprefix("Value error, ")
            lines.append(f"{key}: {message}" if key else message)
    return f"invalid configuration ({source}): " + "; ".join(lines)


def config_file(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Path | None:
    """The file load_config reads: ``path``, else $SANDBOXD_CONFIG, else /etc/sandboxd/config.yaml if present."""
    environ = os.environ if environ is None else environ
    if path is None and environ.get("SANDBOXD_CONFIG"):
        path = Path(environ["SANDBOXD_CONFIG"])
    if path is None and SYSTEM_CONFIG.is_file():
        path = SYSTEM_CONFIG
    return path


def env_keys(environ: Mapping[str, str] | None = None) -> list[str]:
    """The SANDBOXD_* variables that set keys (names only: a value may be a secret)."""
    environ = os.environ if environ is None else environ
    return sorted(name for name in environ if name.startswith("SANDBOXD_") and name != "SANDBOXD_CONFIG")


def load_config(
    path: Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Build the Config. ``path`` None means $SANDBOXD_CONFIG, then /etc/sandboxd/config.yaml if present."""
    environ = os.environ if environ is None else environ
    path = config_file(path, environ)
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text(encoding="utf-8-sig"))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist; pass an existing file to --config.") from None
        except PermissionError:
            raise ConfigError(
                f"config file {path} is not readable by this user; run as root or a member of its group "
                "(sandboxd), or pass another file with --config."
            ) from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(loaded).__name__}.")
        data = loaded
    data = _merge(data, _env_overrides(environ))
    if overrides:
        data = _merge(data, {k: v for k, v in overrides.items() if v is not None})
        source += " + flags"
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None


def iter_keys(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str, Any, str]]:
    """(dotted key, env name, default, description) for every key: docs/config.md is checked against it."""
    rows = []
    for key, field in model.model_fields.items():
        annotation = field.annotation
        dotted = f"{prefix}{key}"
        if isinstance(annotation, type) and issubclass(annotation, _Section):
            rows.extend(iter_keys(annotation, f"{dotted}."))
            continue
        default = field.get_default(call_default_factory=True)
        env = "SANDBOXD_" + dotted.replace(".", "_").upper()
        rows.append((dotted, env, default, field.description or ""))
    return rows


# What a SIGHUP applies to the running daemon (docs/config.md, "What changes need"). A key
# matches an entry exactly or by its section prefix; every other key needs a restart.
LIVE_KEYS = ("pool.", "calls.", "sandbox.", "egress.", "integrations.", "log_level", "log_rate", "log_burst", "max_message_bytes", "allowed_uids", "allowed_gids",
             "allow_unsafe")  # live with the sandbox settings it was checked against
# Exceptions inside live sections: fixed when the backend is built.
RESTART_KEYS = ("calls.max_result_bytes", "sandbox.docker_host")


def needs_restart(key: str) -> bool:
    if key in RESTART_KEYS:
        return True
    return not any(key == live or (live.endswith(".") and key.startswith(live)) for live in LIVE_KEYS)


def flatten(config: Config) -> dict[str, Any]:
    """Dotted key → value, the keys docs/config.md lists."""
    flat: dict[str, Any] = {}

    def walk(data: Mapping[str, Any], prefix: str) -> None:
        for key, value in data.items():
            if isinstance(value, Mapping):
                walk(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value

    walk(config.model_dump(), "")
    return flat
