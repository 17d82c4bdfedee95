"""The data path's ownership: one daemon a data path, and the mount flags that make a tool's files inert."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from sandboxd.errors import ConfigError
from sandboxd.logging import get_logger

log = get_logger("sandboxd.server")

DATA_PATH_LOCK = ".sandboxd.lock"


def lock_data_path(data_path: Path) -> int:
    """Hold DATA_PATH/.sandboxd.lock for the daemon's life (the kernel drops it when the process
    dies): sandboxes are labelled by the data path alone (``instance_id``). Returns the lock's fd;
    closing it lets another daemon take the data path."""
    path = data_path / DATA_PATH_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(
            f"another sandboxd (pid {holder}) serves the data path {data_path}: a data path belongs "
            "to one daemon. Stop that one, or give this one another --data-path."
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def check_data_path_mount(data_path: Path) -> None:
    """Say so when the data path allows setuid files and device nodes.

    Sandboxes can write DATA_PATH/<user>, and Docker cannot mount a bind nosuid,nodev:
    its mount in the sandbox has the flags of the filesystem it lies on. Inside, no new
    privileges and no capabilities make a setuid file or a device node inert anyway; on
    the host, a setuid file a tool leaves is its uid's, which has no account. A data path
    on a nosuid,nodev mount (docs/install.md) makes both inert everywhere.
    """
    flags = os.statvfs(data_path).f_flag
    missing = [name for name, bit in (("nosuid", os.ST_NOSUID), ("nodev", os.ST_NODEV)) if not flags & bit]
    if missing:
        log.warning("data_path_allows_setuid", data_path=str(data_path), missing=missing,
                    hint="mount the data path nosuid,nodev (docs/install.md, 'The sandbox uid')")
