"""Where things are by default, and the values more than one section names."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, get_args

from sandboxd import __version__

SYSTEM_CONFIG = Path("/etc/sandboxd/config.yaml")
REPO_ROOT = Path(__file__).resolve().parents[2]
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
                     "unsandboxed", "mcp_http_remote", "secrets_in_clear"]
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
