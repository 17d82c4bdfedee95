"""Seed sync (docs/tools.md, "Sync"): copy seed tools into DATA_PATH/tools by version.

A seed tool replaces the installed one only when its version is higher, so
edits to an installed tool survive until the seed's version passes theirs.

Replacement is atomic per tool. The new copy is built in a hidden directory
beside the target (same filesystem), then two renames swap it in:

    NAME → .old-NAME-<token>,  .new-NAME-<token> → NAME,  then .old-NAME-<token> is removed

A crash can stop this between any two steps. Every sync starts by recovering:
an ``.old-NAME-*`` whose NAME is missing is renamed back (the crash came
between the two renames), every other leftover is removed. So a crash leaves
the old tool or the new one, never a mix. Discovery ignores hidden
directories, so leftovers are never listed as tools.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Literal

from sandboxd.tools.manifest import MANIFEST_FILE, read_version

_LEFTOVER_RE = re.compile(r"^\.(?P<kind>old|new)-(?P<name>.+)-[0-9a-f]{8}$")


@dataclass(frozen=True)
class SyncAction:
    name: str
    action: Literal["installed", "updated", "kept"]
    seed_version: int
    installed_version: int | None  # before this sync; None when the tool was not installed

    def __str__(self) -> str:
        if self.action == "installed":
            return f"installed {self.name} (v{self.seed_version})"
        if self.action == "updated":
            return f"updated {self.name} (v{self.installed_version} → v{self.seed_version})"
        return f"kept {self.name} (v{self.installed_version}, seed v{self.seed_version})"


def sync_tools(seed_dir: Path, tools_dir: Path) -> list[SyncAction]:
    """Install or update every seed tool in ``tools_dir``; one action per seed tool, sorted by name."""
    seed_dir, tools_dir = Path(seed_dir), Path(tools_dir)
    if not seed_dir.is_dir():
        raise NotADirectoryError(f"seed tools directory {seed_dir} does not exist or is not a directory")
    tools_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(tools_dir):
        recover(tools_dir)
        return [_sync_one(source, tools_dir) for source in seed_tools(seed_dir)]


def seed_tools(seed_dir: Path) -> list[Path]:
    """The seed's tool directories (those holding a TOOL.md), by name."""
    return sorted(path for path in seed_dir.iterdir()
                  if not path.name.startswith(".") and path.is_dir() and (path / MANIFEST_FILE).is_file())


def recover(tools_dir: Path) -> None:
    """Undo what an interrupted sync left: restore a tool caught mid-swap, drop other leftovers."""
    for entry in sorted(os.listdir(tools_dir)):
        match = _LEFTOVER_RE.match(entry)
        if match is None:
            continue
        target = tools_dir / match["name"]
        if match["kind"] == "old" and not os.path.lexists(target):
            os.rename(tools_dir / entry, target)
        else:
            _remove(tools_dir / entry)
    _fsync(tools_dir)


def _sync_one(source: Path, tools_dir: Path) -> SyncAction:
    name = source.name
    seed_version = read_version(source / MANIFEST_FILE)
    target = tools_dir / name
    if not os.path.lexists(target):
        _replace(source, target)
        return SyncAction(name, "installed", seed_version, None)
    installed_version = read_version(target / MANIFEST_FILE)
    if seed_version > installed_version:
        _replace(source, target)
        return SyncAction(name, "updated", seed_version, installed_version)
    return SyncAction(name, "kept", seed_version, installed_version)


def _replace(source: Path, target: Path) -> None:
    token = secrets.token_hex(4)
    staging = target.with_name(f".new-{target.name}-{token}")
    try:
        shutil.copytree(source, staging, symlinks=True)
        _fsync_tree(staging)  # the copy must be on disk before a rename makes it the tool
    except BaseException:
        _remove(staging)
        raise
    if os.path.lexists(target):
        old = target.with_name(f".old-{target.name}-{token}")
        os.rename(target, old)
        os.rename(staging, target)
        _fsync(target.parent)
        _remove(old)
    else:
        os.rename(staging, target)
        _fsync(target.parent)


@contextlib.contextmanager
def _exclusive(tools_dir: Path) -> Iterator[None]:
    """One sync at a time per directory: a second one would take the first's staging copies for leftovers."""
    fd = os.open(tools_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for directory, _, files in os.walk(root):
        for name in files:
            path = Path(directory, name)
            if not path.is_symlink():
                _fsync(path)
        _fsync(Path(directory))
