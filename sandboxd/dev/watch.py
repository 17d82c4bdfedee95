"""Notice edits to a tool folder by polling: no dependency, and it works on every filesystem.

A snapshot maps each file's path to (mtime, size, inode); editors that replace
files change the inode, editors that write in place change mtime or size.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

POLL_INTERVAL_S = 0.3
MAX_WATCHED_FILES = 5000  # a tool folder is small; this bounds the cost of a stray node_modules-like tree
IGNORED_DIRS = frozenset({"node_modules"})

Snapshot = dict[str, tuple[int, int, int]]


def snapshot(root: Path) -> Snapshot:
    """Every file under ``root`` except hidden ones and node_modules, with what identifies its content."""
    files: Snapshot = {}
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in IGNORED_DIRS)
        for name in names:
            if name.startswith("."):
                continue  # editors' swap and backup files
            path = os.path.join(directory, name)
            try:
                info = os.stat(path)
            except OSError:
                continue  # removed between the listing and the stat
            files[os.path.relpath(path, root)] = (info.st_mtime_ns, info.st_size, info.st_ino)
            if len(files) >= MAX_WATCHED_FILES:
                return files
    return files


def changed_files(before: Snapshot, after: Snapshot) -> list[str]:
    """Paths added, removed or modified, sorted."""
    return sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))


async def wait_for_change(root: Path, before: Snapshot, stop: asyncio.Event,
                          interval: float = POLL_INTERVAL_S) -> Snapshot | None:
    """The folder's snapshot once it differs from ``before`` and has settled; None when ``stop`` is set.

    "Settled" means two polls in a row agree, so a save that writes several files
    (or writes one file in steps) triggers one run, not several.
    """
    current = before
    while True:
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return None
        except TimeoutError:
            pass
        latest = await asyncio.to_thread(snapshot, root)
        if latest != before and latest == current:
            return latest
        current = latest
