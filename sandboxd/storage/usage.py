"""What a user's folders hold: a bounded walk that never follows a link.

Bytes are allocated blocks (st_blocks x 512), not st_size: a 1-TiB sparse file a tool
planted costs the disk nothing and counts nothing; a fallocated one counts in full.
A file with several links counts once. The walk stops one entry past the inode limit:
past it the answer (over) is known, and a tool cannot make the walk as long as it likes.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Usage:
    bytes: int
    inodes: int
    complete: bool  # False: the walk stopped at its bound, so both figures are lower bounds


def measure(folders: list[Path], max_inodes: int) -> Usage:
    """Blocks and entries under ``folders`` (each counted with its own folder); stops past ``max_inodes``."""
    total = inodes = 0
    seen: set[tuple[int, int]] = set()  # (dev, ino) of files with more than one link
    pending: list[str] = []
    for folder in folders:
        try:
            info = os.lstat(folder)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode):
            continue
        total += info.st_blocks * 512
        inodes += 1
        pending.append(str(folder))
    while pending:
        if inodes > max_inodes:
            return Usage(total, inodes, False)
        try:
            entries = os.scandir(pending.pop())
        except OSError:
            continue  # removed meanwhile, or a folder a tool made unreadable to us
        with entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode):
                    key = (info.st_dev, info.st_ino)
                    if key in seen:
                        continue
                    seen.add(key)
                total += info.st_blocks * 512
                inodes += 1
                if stat.S_ISDIR(info.st_mode):
                    pending.append(entry.path)
                if inodes > max_inodes:
                    return Usage(total, inodes, False)
    return Usage(total, inodes, True)
