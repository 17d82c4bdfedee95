"""What a user's folders hold: a bounded walk that never follows a link and sees every entry.

Bytes are allocated blocks (st_blocks x 512), not st_size: a 1-TiB sparse file a tool
planted costs the disk nothing and counts nothing; a fallocated one counts in full.
A file with several links counts once. The walk stops one entry past the inode limit:
past it the answer (over) is known, and a tool cannot make the walk as long as it likes.

The walk goes by directory descriptors (openat, fstatat), never by path, so a tree deeper
than PATH_MAX counts like any other. It holds at most MAX_OPEN_DIRS of them whatever the
depth: a folder whose descriptor it closed is reopened through '..', checked by its device
and inode. What it cannot read (a folder a tool made unreadable to the daemon) never counts
as nothing: the usage names it (``unreadable``), and the quota takes the user for over it.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

MAX_OPEN_DIRS = 32  # the walk's own descriptors, besides scandir's one
BIGGEST = 3  # entries a soft-mode refusal names
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Removed or replaced by a file or a link since it was listed: nothing of it is left to count here.
_GONE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP})


@dataclass(frozen=True)
class Usage:
    bytes: int
    inodes: int
    complete: bool  # False: the walk stopped at its bound, so both figures are lower bounds
    unreadable: str | None = None  # a path the walk could not read, and why: its content is unknown
    # (path, bytes) of the entries right under the folders, most first: what a soft refusal names.
    biggest: tuple[tuple[str, int], ...] = field(default=(), compare=False)


@dataclass
class _Dir:
    name: str  # within its parent (the first: the folder's whole path)
    ident: tuple[int, int]  # (st_dev, st_ino): checked when it is reopened through '..'
    fd: int  # -1 while closed to keep the walk's descriptors bounded
    subdirs: list[str] = field(default_factory=list)  # still to walk


def _ident(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _close(level: _Dir) -> None:
    if level.fd >= 0:
        os.close(level.fd)
        level.fd = -1


class _Walk:
    """One measurement: the counts so far, and the first thing it could not read."""

    def __init__(self, max_inodes: int, biggest: int = BIGGEST) -> None:
        self.max_inodes = max_inodes
        self.biggest = biggest
        self.bytes = self.inodes = 0
        self.seen: set[tuple[int, int]] = set()  # files with more than one link, counted once
        self.unreadable: str | None = None
        self.most_open = 0  # the most descriptors the walk held at once (the tests check the bound)
        self.by_entry: dict[str, int] = {}  # bytes under each entry right below a measured folder

    @property
    def stopped(self) -> bool:
        return self.inodes > self.max_inodes or self.unreadable is not None

    def usage(self) -> Usage:
        biggest = sorted(self.by_entry.items(), key=lambda item: -item[1])[:self.biggest]
        return Usage(self.bytes, self.inodes, not self.stopped, self.unreadable, tuple(biggest))

    def count(self, info: os.stat_result, entry: str | None = None) -> None:
        """Count one inode; ``entry``: the entry right below the measured folder that holds it."""
        if info.st_nlink > 1 and not stat.S_ISDIR(info.st_mode):
            key = _ident(info)
            if key in self.seen:
                return
            self.seen.add(key)
        self.bytes += info.st_blocks * 512
        self.inodes += 1
        if entry is not None:
            self.by_entry[entry] = self.by_entry.get(entry, 0) + info.st_blocks * 512

    def folder(self, folder: Path) -> None:
        """Count ``folder`` and everything under it (not there, or a link: nothing)."""
        try:
            fd = os.open(folder, _DIR_FLAGS)
        except OSError as exc:
            if exc.errno not in _GONE:
                self.unreadable = f"{folder} ({exc.strerror})"
            return
        info = os.fstat(fd)
        self.count(info)
        stack = [_Dir(str(folder), _ident(info), fd)]
        first_open = 1  # stack[0] and stack[first_open:] hold descriptors; those between were closed
        try:
            self._list(stack)
            while stack and not self.stopped:
                first_open = self._step(stack, first_open)
        finally:
            for level in stack:
                _close(level)

    def _step(self, stack: list[_Dir], first_open: int) -> int:
        """Walk into the top folder's next subfolder, or leave it when done; returns the new ``first_open``."""
        top = stack[-1]
        if not top.subdirs:
            stack.pop()
            if stack and stack[-1].fd < 0:  # its parent was closed on the way down
                self._reopen(stack, top)
                first_open -= 1
            _close(top)
            return first_open
        name = top.subdirs.pop()
        try:
            fd = os.open(name, _DIR_FLAGS, dir_fd=top.fd)
        except OSError as exc:
            if exc.errno not in _GONE:
                self.unreadable = f"{_path(stack, name)} ({exc.strerror})"
            return first_open
        stack.append(_Dir(name, _ident(os.fstat(fd)), fd))
        if len(stack) - first_open + 1 > MAX_OPEN_DIRS:  # the shallowest open one (not the root) closes
            _close(stack[first_open])
            first_open += 1
        self.most_open = max(self.most_open, len(stack) - first_open + 1)
        self._list(stack)
        return first_open

    def _list(self, stack: list[_Dir]) -> None:
        """Count the top folder's entries, and note its subfolders to walk."""
        top = stack[-1]
        try:
            with os.scandir(top.fd) as entries:
                for entry in entries:
                    try:
                        info = os.stat(entry.name, dir_fd=top.fd, follow_symlinks=False)
                    except OSError as exc:
                        if exc.errno in _GONE:
                            continue
                        raise
                    # What a refusal names as the biggest: each entry right below the folder, with all under it.
                    self.count(info, f"{stack[0].name}/{entry.name if len(stack) == 1 else stack[1].name}")
                    if stat.S_ISDIR(info.st_mode):
                        top.subdirs.append(entry.name)
                    if self.stopped:
                        return
        except OSError as exc:
            self.unreadable = f"{_path(stack)} ({exc.strerror})"

    def _reopen(self, stack: list[_Dir], child: _Dir) -> None:
        """Reopen the (closed) top of ``stack`` through ``child``'s '..', or from the root name by name
        when a folder was moved meanwhile; unreadable if neither finds the same folder."""
        parent = stack[-1]
        parent.fd = _open_checked("..", child.fd, parent.ident)
        if parent.fd >= 0:
            return
        fd = stack[0].fd
        for level in stack[1:]:
            opened = _open_checked(level.name, fd, level.ident)
            if fd != stack[0].fd:
                os.close(fd)
            if opened < 0:
                self.unreadable = f"{_path(stack)} (moved while it was measured)"
                stack[:] = stack[:1]  # nothing below the root can be reached again
                return
            fd = opened
        parent.fd = fd


def _open_checked(name: str, dir_fd: int, ident: tuple[int, int]) -> int:
    """``name`` under ``dir_fd`` opened as a folder if it is the one ``ident`` names, else -1."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return -1
    if _ident(os.fstat(fd)) == ident:
        return fd
    os.close(fd)
    return -1


def _path(stack: list[_Dir], name: str | None = None) -> str:
    """Where the walk is, for the log: shortened in the middle past 300 characters (it may be past PATH_MAX)."""
    path = "/".join([level.name for level in stack] + ([name] if name is not None else []))
    return path if len(path) <= 300 else f"{path[:150]}...{path[-147:]}"


def measure(folders: list[Path], max_inodes: int, *, biggest: int = BIGGEST) -> Usage:
    """Blocks and entries under ``folders`` (each counted with its own folder); stops past ``max_inodes``
    or at the first thing it cannot read (then ``unreadable`` names it)."""
    walk = _Walk(max_inodes, biggest)
    for folder in folders:
        if walk.stopped:
            break
        walk.folder(folder)
    return walk.usage()
