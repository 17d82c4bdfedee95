"""`sandboxd storage free`: what holds the most in a user's folders, and its removal by the operator.

Paths are named as the user's sandboxes see them (``/officer/user/cache``), as a soft-mode
refusal names them. A removal opens the entry's folder below the user's folder without
following links, and removes the entry from that handle (``shutil.rmtree`` with ``dir_fd``
never follows a link either): a link a tool planted is removed, never what it points at.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from sandboxd.config import Config
from sandboxd.sandbox.mounts import open_beneath
from sandboxd.storage.provision import SANDBOX_PATHS, areas
from sandboxd.storage.usage import Usage, measure

LISTED = 10  # entries `storage free USER` lists


class NotAPath(ValueError):
    """A path that is not below /officer/user or /officer/data; the message names the form."""


@dataclass(frozen=True)
class Held:
    usage: Usage
    limit_bytes: int
    limit_inodes: int


def held(config: Config, user: str) -> Held:
    """What ``user``'s folders hold now (a walk; the biggest entries named as a sandbox sees them)."""
    limit_bytes, limit_inodes = config.storage.limits(user)
    folders = {str(area.folder(config, user)): SANDBOX_PATHS[area.name] for area in areas(config)}
    usage = measure([Path(folder) for folder in folders], 10 * limit_inodes, biggest=LISTED)
    shown = []
    for path, size in usage.biggest:
        folder, _, name = path.rpartition("/")
        shown.append((f"{folders.get(folder, folder)}/{name}", size))
    return Held(Usage(usage.bytes, usage.inodes, usage.complete, usage.unreadable, tuple(shown)),
                limit_bytes, limit_inodes)


def host_path(config: Config, user: str, path: str) -> Path:
    """The host path of ``path`` as ``user``'s sandbox sees it; NotAPath unless it is strictly below a mount."""
    pure = PurePosixPath(path)
    for area in areas(config):
        mount = PurePosixPath(SANDBOX_PATHS[area.name])
        if pure.is_relative_to(mount) and pure != mount:
            parts = pure.relative_to(mount).parts
            if any(part in ("", ".", "..") for part in parts):
                break
            return area.folder(config, user).joinpath(*parts)
    raise NotAPath(f"{path!r} is not a path below /officer/user or /officer/data, as `sandboxd storage free "
                   f"{user}` lists them (e.g. /officer/user/cache)")


def remove(config: Config, user: str, path: str) -> bool:
    """Remove the file or folder ``path`` (as a sandbox sees it) of ``user``; False when it was not there.

    UnsafeMount (an OSError's sibling) when a folder on the way is a link: nothing is removed then.
    """
    target = host_path(config, user, path)
    folder = next(area.folder(config, user) for area in areas(config) if target.is_relative_to(area.folder(config, user)))
    try:
        parent_fd, _ = open_beneath(folder.parent, target.parent, "dir", flags=os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return False
    try:
        try:
            info = os.lstat(target.name, dir_fd=parent_fd)
        except FileNotFoundError:
            return False
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(target.name, dir_fd=parent_fd)
        else:
            os.unlink(target.name, dir_fd=parent_fd)
    finally:
        os.close(parent_fd)
    return True
