"""A moved user's copy on the host they left: set aside (renamed, read-only, never served), removed later.

After a move's flip (docs/scale.md, "Moves and drains") the old host keeps the user's folders
for ``cluster.keep_moved_s`` under a name no user can have, so an operator can still recover
a file; a maintenance task removes them once that time is up. A move's target also removes
an import the move could not flip to (``remove_user``).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from sandboxd.config import Config
from sandboxd.logging import get_logger
from sandboxd.storage import btrfs
from sandboxd.storage.provision import areas

log = get_logger("sandboxd.storage")

MOVED_MARK = "~sandboxd-moved-"  # "~" is in no user name (users.py): never measured or served as a user
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def set_aside(config: Config, user: str, now: float | None = None) -> list[Path]:
    """Rename each of ``user``'s folders to ``<user>~sandboxd-moved-<unix time>``, read-only; the new paths."""
    stamp = int(time.time() if now is None else now)
    moved = []
    for area in areas(config):
        folder = area.folder(config, user)
        if not os.path.lexists(folder) or os.path.islink(folder):
            continue
        aside = folder.with_name(f"{folder.name}{MOVED_MARK}{stamp}")
        os.rename(folder, aside)
        _make_read_only(aside)
        moved.append(aside)
    return moved


def _make_read_only(folder: Path) -> None:
    """A subvolume read-only for everyone (root); else the folder's own write bits taken away."""
    fd = os.open(folder, _DIR)
    try:
        if os.geteuid() == 0 and os.fstat(fd).st_ino == btrfs.SUBVOLUME_ROOT_INO and btrfs.filesystem_id(fd):
            btrfs.set_read_only(fd)
        else:
            os.fchmod(fd, os.fstat(fd).st_mode & 0o555)
    except OSError as exc:
        log.warning("moved_copy_writable", folder=str(folder), error=str(exc))
    finally:
        os.close(fd)


def set_aside_at(name: str) -> int | None:
    """When a folder named ``name`` was set aside (unix time), or None for any other name."""
    _, mark, stamp = name.rpartition(MOVED_MARK)
    return int(stamp) if mark and stamp.isdigit() else None


def remove_expired(config: Config, keep_s: float, now: float | None = None) -> list[Path]:
    """Remove the copies set aside more than ``keep_s`` ago; the paths removed."""
    now = time.time() if now is None else now
    removed = []
    for root in {area.root for area in areas(config) if area.per_user_root}:
        try:
            names = os.listdir(root)
        except FileNotFoundError:
            continue
        for name in names:
            at = set_aside_at(name)
            if at is not None and now - at >= keep_s:
                remove_folder(root, name)
                removed.append(root / name)
    return removed


def remove_user(config: Config, user: str) -> list[Path]:
    """Remove every folder of ``user`` here (an import a move could not flip to); the paths removed."""
    removed = []
    for area in areas(config):
        folder = area.folder(config, user)
        if os.path.lexists(folder):
            remove_folder(folder.parent, folder.name)
            removed.append(folder)
    return removed


def remove_folder(root: Path, name: str) -> None:
    """``root/name`` and what it holds: a subvolume deleted as one (root), else the tree (made writable first)."""
    root_fd = os.open(root, _DIR)
    try:
        if os.geteuid() == 0 and btrfs.filesystem_id(root_fd) is not None:
            try:
                btrfs.delete_subvolume(root_fd, name)
                return
            except OSError:
                pass  # a plain folder: removed below
        fd = os.open(name, _DIR, dir_fd=root_fd)
        try:
            os.fchmod(fd, 0o700)  # set aside read-only: its entries could not be removed
        finally:
            os.close(fd)
        shutil.rmtree(name, dir_fd=root_fd)
    finally:
        os.close(root_fd)
