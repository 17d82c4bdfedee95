"""Whether a scanned tools root still holds as scanned, from stat results alone (the fallback where
inotify cannot watch it, tools/inotify.py): what a scan depends on, and the window in which a
change could leave every timestamp as the scan saw it."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from sandboxd.tools.manifest import MANIFEST_FILE
from sandboxd.tools.tool import ENTRY_FILES, Skipped, Tool

# File timestamps come from a coarse clock (the kernel's tick; whole seconds on some
# filesystems), so a change made within one step of that clock after a scan may leave
# every timestamp as the scan saw it. A root holding anything changed within the window
# before its scan is scanned again at every listing until the window has passed ("racy
# git"). The window is per file: a ctime with a sub-second part comes from a filesystem
# that keeps fractions, whose clock steps by a tick (≤ 10 ms); only whole-second
# timestamps need the long window. (ctime is set by the kernel, so no tool can forge it.)
RACY_WINDOW_NS = 2_000_000_000  # whole-second timestamps (FAT's are 2 s)
RACY_WINDOW_FINE_NS = 50_000_000  # sub-second timestamps: five ticks at HZ=100
StatKey = tuple[int, int, int, int, int, int] | None


def stat_key(path: str) -> StatKey:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_mode)


def entry_keys(root: str, name: str) -> tuple[StatKey, ...]:
    """What a scan reads in one entry: TOOL.md and the first of ENTRY_FILES that is a regular file."""
    tool_dir = f"{root}/{name}"
    keys = [stat_key(f"{tool_dir}/{MANIFEST_FILE}")]
    for entry in ENTRY_FILES:
        key = stat_key(f"{tool_dir}/{entry}")
        keys.append(key)
        if key is not None and stat.S_ISREG(key[5]):
            break
    return tuple(keys)


@dataclass(frozen=True)
class Fingerprint:
    """What a scan of a root depends on, in stat results.

    Adding, removing or renaming an entry changes the root's mtime. The files' own
    stats (links followed) show an edit in place, a replacement, a file that appears
    or goes, and a dangling link whose target appears. (Not seen: a dangling link to
    a directory whose target appears empty, which changes only a diagnostic.)
    """

    root: StatKey
    entries: dict[str, tuple[StatKey, ...]]

    @classmethod
    def take(cls, root: str, names: list[str]) -> Fingerprint:
        return cls(stat_key(root), {name: entry_keys(root, name) for name in names})

    def racy(self, scanned_at_ns: int) -> bool:
        keys = [self.root, *(key for keys in self.entries.values() for key in keys)]
        return any(key is not None and racy_key(key, scanned_at_ns) for key in keys)


def racy_key(key: tuple[int, int, int, int, int, int], scanned_at_ns: int) -> bool:
    """Whether a change just after the scan could have left this stat as the scan saw it."""
    mtime_ns, ctime_ns = key[3], key[4]
    window = RACY_WINDOW_FINE_NS if ctime_ns % 1_000_000_000 else RACY_WINDOW_NS
    return max(mtime_ns, ctime_ns) >= scanned_at_ns - window


@dataclass(eq=False)
class Snapshot:
    """The last full scan of a root, trusted while the root's fingerprint is unchanged."""

    fingerprint: Fingerprint
    racy: bool
    tools: list[Tool]
    skipped: list[Skipped]
    by_name: dict[str, Tool]
    verified_at: float  # time.monotonic() of the last full check that held
    scanned_at: float  # time.monotonic() just before the scan listed the root

    def unchanged(self, root: Path) -> bool:
        return Fingerprint.take(str(root), list(self.fingerprint.entries)) == self.fingerprint

    def holds_for(self, root: Path, name: str) -> bool:
        """The cheap check behind get(): the root's entry list, and the files of the tool called ``name``."""
        if stat_key(str(root)) != self.fingerprint.root:
            return False
        tool = self.by_name.get(name)
        return tool is None or entry_keys(str(root), tool.dir.name) == self.fingerprint.entries.get(tool.dir.name)
