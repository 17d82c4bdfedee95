"""Which tools roots changed since their last scan, told by the kernel (inotify) instead of stat calls.

A tools/call used to stat its roots and its tool's files (four stat calls, ~29k instructions,
about 4% of a warm call) to see whether the tool changed. Here a scan first watches the
directories it reads, and a lookup drains the inotify queue (one non-blocking read) and
trusts a root no event touched since. Events are queued by the kernel when the change is
made, so a change finished before a call was sent is seen by that call ("discovery is live").

What inotify would not see makes a root unwatched, and its lookups stat as before: a TOOL.md
or entry file that is a symbolic link or has other hard links (edited through another path),
no inotify on this system, or no watch left (MAX_WATCHES, fs.inotify.max_user_watches).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import struct
import termios
import threading
import weakref
from pathlib import Path
from typing import Iterable

_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
# Anything that changes what a scan reads: an entry added, removed, renamed, written, its mode changed.
_MASK = (0x2 | 0x4 | 0x8 | 0x40 | 0x80 | 0x100 | 0x200 | 0x400 | 0x800)  # MODIFY ATTRIB CLOSE_WRITE MOVED_* CREATE DELETE*
_IN_Q_OVERFLOW = 0x4000
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (then len bytes of name)
_READ_SIZE = 64 << 10
_FIONREAD, _NONE_QUEUED = termios.FIONREAD, bytes(4)  # FIONREAD's answer (an int of bytes queued) when empty
# Watches one catalog holds at most (each costs the kernel ~1 KB, and fs.inotify.max_user_watches is shared
# with the rest of the host); the roots past it are stat'ed.
MAX_WATCHES = 8192

try:
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - no C library to load: every root is stat'ed
    _libc = None


class RootWatcher:
    """Roots whose directories are watched, and whether an event touched them since they were armed.

    ``arm`` runs in a scan's worker thread, ``unchanged`` on the event loop: one lock.
    """

    def __init__(self, fd: int, files: tuple[str, ...]) -> None:
        self._fd = fd
        self._files = files  # what a scan reads in a tool directory
        self._lock = threading.Lock()
        self._roots_by_wd: dict[int, set[Path]] = {}
        self._wds_by_root: dict[Path, list[int]] = {}
        self._clean: set[Path] = set()  # armed roots no event has touched since
        self._version = 0  # grows whenever a root may have left _clean: what was concluded from it is void
        self._queued = bytearray(4)  # FIONREAD's answer: bytes in the queue
        self._finalizer = weakref.finalize(self, os.close, fd)

    @classmethod
    def create(cls, files: tuple[str, ...]) -> RootWatcher | None:
        """A watcher of tool directories whose ``files`` a scan reads, or None where inotify is not
        available (then every lookup stats)."""
        if _libc is None or not hasattr(_libc, "inotify_init1"):
            return None
        fd = _libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        return cls(fd, files) if fd >= 0 else None

    def close(self) -> None:
        self._finalizer()

    def arm(self, root: Path, tool_dirs: Iterable[Path], *, stop_at: Path) -> bool:
        """Watch ``root`` (its nearest existing ancestor up to ``stop_at`` while it does not exist) and
        ``tool_dirs``, before the scan reads them; False (the root is stat'ed) when inotify cannot see it all."""
        with self._lock:
            self._drain()  # events from before this scan are about what it reads anyway
            self._forget(root)
            watched = _existing(root, stop_at)
            dirs = [watched, *tool_dirs] if watched == root else [watched]
            if len(self._roots_by_wd) + len(dirs) > MAX_WATCHES:
                return False
            if watched == root and not all(_watchable(tool_dir, self._files) for tool_dir in tool_dirs):
                return False
            wds: list[int] = []
            for directory in dirs:
                wd = _libc.inotify_add_watch(self._fd, os.fsencode(directory), _MASK) if _libc else -1
                if wd < 0:  # ENOSPC (no watch left), EACCES, gone meanwhile: stat this root
                    self._wds_by_root[root] = wds
                    self._forget(root)
                    return False
                wds.append(wd)
                self._roots_by_wd.setdefault(wd, set()).add(root)
            self._wds_by_root[root] = wds
            if watched != root and root.is_dir():  # made before its ancestor's watch: no event would tell
                self._forget(root)
                return False
            self._clean.add(root)
            return True

    def version(self) -> int:
        """After one read of the queue: the count of times a root may have left the clean ones so far."""
        with self._lock:
            self._drain()
            return self._version

    def unchanged(self, root: Path) -> bool:
        """``root`` is watched and no event touched it since its scan (one read of the queue, usually empty)."""
        return bool(self.clean((root,)))

    def clean(self, roots: Iterable[Path]) -> set[Path]:
        """Those of ``roots`` watched and untouched since their scans, for one read of the queue."""
        with self._lock:
            self._drain()
            return {root for root in roots if root in self._clean}

    def forget(self, root: Path) -> None:
        with self._lock:
            self._forget(root)

    def _forget(self, root: Path) -> None:
        self._clean.discard(root)
        self._version += 1
        for wd in self._wds_by_root.pop(root, ()):
            roots = self._roots_by_wd.get(wd)
            if roots is None:
                continue
            roots.discard(root)
            if not roots:
                del self._roots_by_wd[wd]
                if _libc is not None:
                    _libc.inotify_rm_watch(self._fd, wd)

    def _drain(self) -> None:
        while True:
            try:
                # How much is queued, without a raise for the empty queue of nearly every call.
                fcntl.ioctl(self._fd, _FIONREAD, self._queued)
                if self._queued == _NONE_QUEUED:
                    return
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:  # pragma: no cover - the queue cannot be read: trust nothing
                if exc.errno != errno.EINTR:
                    self._clean.clear()
                    self._version += 1
                    return
                continue
            self._version += 1  # the events below may touch any root
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                offset += _EVENT.size + length
                if mask & _IN_Q_OVERFLOW:  # events were lost: every root is scanned again
                    self._clean.clear()
                    continue
                for root in self._roots_by_wd.get(wd, ()):
                    self._clean.discard(root)


def _existing(path: Path, stop_at: Path) -> Path:
    """``path``, or its nearest ancestor that exists (not above ``stop_at``)."""
    while not path.is_dir() and path != stop_at and path.parent != path:
        path = path.parent
    return path


def _watchable(tool_dir: Path, files: tuple[str, ...]) -> bool:
    """Whether a watch on ``tool_dir`` sees every edit of its ``files`` (no link leads elsewhere)."""
    for name in files:
        try:
            info = os.lstat(tool_dir / name)
        except FileNotFoundError:
            continue
        except OSError:
            return False
        if stat.S_ISLNK(info.st_mode) or (stat.S_ISREG(info.st_mode) and info.st_nlink > 1):
            return False
    return True
