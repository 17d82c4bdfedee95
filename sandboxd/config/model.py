"""The whole configuration (``Config``), and the checks that read more than one section."""

from __future__ import annotations

import grp
import os
import pwd
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import Field, field_validator, model_validator

from sandboxd.config.defaults import (BRIDGE_NETWORK, DEFAULT_EMAIL_DB, EMAIL_DB_NAME, UNSAFE_NAMES, UnsafeName,
                                      default_data_path, default_seed_tools, default_socket_path)
from sandboxd.config.sections import (CallsConfig, EgressConfig, IntegrationsConfig, MetricsConfig, PoolConfig,
                                      SandboxConfig, Section, ToolsConfig)
from sandboxd.config.cluster import ClusterConfig
from sandboxd.config.storage import StorageConfig
from sandboxd.errors import ConfigError
from sandboxd.rules.secrets import CLEAR_SCHEME


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


class Config(Section):
    data_path: Path = Field(default_factory=default_data_path, description="Root of tools and user data.")
    seed_tools: Path | None = Field(default_factory=default_seed_tools, description="Seed tools synced into DATA_PATH/tools at start.")
    socket: Path = Field(default_factory=default_socket_path, description="Unix socket the daemon listens on.")
    socket_mode: int = Field(0o660, description="File mode of the socket (octal in YAML: '0660').")
    socket_group: str | None = Field(None, description="Group that owns the socket.")
    allowed_uids: list[int] = Field(default_factory=list, description="Users (uid or name) whose connections are served, besides root and the daemon's own user; both lists empty = anyone who can open the socket.")
    allowed_gids: list[int] = Field(default_factory=list, description="Groups (gid or name) whose members' connections are served (primary or supplementary group).")
    backend: Literal["docker", "process", "fake"] = Field("docker", description="Sandbox backend; process runs tools UNSANDBOXED (serve needs allow_unsafe: [unsandboxed]).")
    allow_unsafe: list[UnsafeName] = Field(default_factory=list, description="Dangerous settings accepted on purpose, by name: host_network, shared_network, direct_network, cap_add, writable_root, host_uid, unsandboxed, mcp_http_remote, secrets_in_clear.")
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
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    cluster: ClusterConfig | None = Field(None, description="This host among several (docs/scale.md); null = a standalone host, no etcd.")

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
    clear = [entry for hosts in config.egress.secrets.values() for entry in hosts
             if entry.strip().lower().startswith(CLEAR_SCHEME)]
    if clear:
        add("secrets_in_clear", f"egress.secrets entries {', '.join(clear)} let a secret's value cross the network "
                                "in plain HTTP, readable on the way; name the host without http:// for TLS only")
    if config.backend == "process":
        add("unsandboxed", "backend 'process' runs tools as local node processes with this daemon's rights, "
                           "files and network: nothing isolates them (development only)")
    return found


def check_unsandboxed(config: Config) -> None:
    """For ``serve``: the process backend only when ``allow_unsafe`` names it (``sandboxd run`` asks by flag)."""
    for name, message in unsafe_settings(config):
        if name == "unsandboxed" and name not in config.allow_unsafe:
            raise ConfigError(f"invalid configuration: {message}")
