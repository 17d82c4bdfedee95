"""Finding tools: global ones in DATA_PATH/tools, then the user's in DATA_PATH/<user>/tools.

Every listing looks at the disk again, so a tool that is added, edited or
removed is seen at once without a restart; parsed manifests are cached by the
identity of their TOOL.md (path, mtime, size, inode), so listing an unchanged
tree re-parses nothing. Every tools/call looks its tool up this way, so a root
whose fingerprint (a stat of the root, of each entry in it, of its TOOL.md and
entry file) is unchanged answers from the last scan: a few stat calls instead of
a walk with realpath checks (docs/performance.md).

Sandboxes mount only the tools roots, and the daemon reads TOOL.md on the host:
a tool directory, TOOL.md or entry file that resolves outside its root is
refused rather than followed.
"""

from __future__ import annotations

import copy
import os
import stat
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Literal

from sandboxd.tools.manifest import MANIFEST_FILE, Manifest, Problem, parse_manifest
from sandboxd.tools.schema import input_schema
from sandboxd.users import check_user, global_tools_dir, user_tools_dir

ENTRY_FILES = ("index.ts", "index.js")  # in order of preference
Source = Literal["global", "user"]
ParseFn = Callable[[Path, Path], tuple[Manifest | None, list[Problem]]]


@dataclass(frozen=True)
class Tool:
    manifest: Manifest
    dir: Path
    entry: Path
    source: Source

    @property
    def name(self) -> str:
        return self.manifest.name

    @cached_property
    def schema(self) -> dict[str, Any]:
        """The inputSchema; shared, so treat it as read-only (to_protocol hands out copies)."""
        return input_schema(self.manifest)

    def to_protocol(self) -> dict[str, Any]:
        """The Tool object of PROTOCOL.md's tools/list, keys in the spec's order."""
        manifest = self.manifest
        return {
            "name": manifest.name,
            "label": manifest.label,
            "description": manifest.description,
            "version": manifest.version,
            "language": manifest.language,
            "source": self.source,
            "inputSchema": copy.deepcopy(self.schema),
            "documentation": manifest.body,
        }


@dataclass(frozen=True)
class Skipped:
    """A directory that is not a usable tool, and why."""

    dir: Path
    source: Source
    problems: list[Problem]


def _parse(manifest_path: Path, root: Path) -> tuple[Manifest | None, list[Problem]]:
    return parse_manifest(manifest_path, within=root)  # looked up at call time, so tests can count parses


def inspect_tool_dir(tool_dir: Path, root: Path, source: Source,
                     parse: ParseFn = _parse) -> tuple[Tool | None, list[Problem]]:
    """The tool in ``tool_dir`` (None if unusable) and every problem found, warnings included."""
    real_root = root.resolve()
    problems: list[Problem] = []
    if not tool_dir.resolve().is_relative_to(real_root):
        return None, [_outside(tool_dir, real_root)]

    manifest_path = tool_dir / MANIFEST_FILE
    entry = next((tool_dir / name for name in ENTRY_FILES if (tool_dir / name).is_file()), None)
    if entry is None:
        problems.append(Problem(tool_dir, f"no entry file ({' or '.join(ENTRY_FILES)})",
                                "add index.ts exporting 'async function execute(toolCallId, params)'"))
    elif not entry.resolve().is_relative_to(real_root):
        problems.append(_outside(entry, real_root))
    manifest = None
    if os.path.lexists(manifest_path):  # a broken link or a FIFO is for the parser to explain
        manifest, manifest_problems = parse(manifest_path, root)
        problems.extend(manifest_problems)
    else:
        problems.append(Problem(tool_dir, f"no {MANIFEST_FILE}",
                                f"add {MANIFEST_FILE} with name, description and version frontmatter"))

    if manifest is None or entry is None or any(p.is_error for p in problems):
        return None, problems
    return Tool(manifest, tool_dir, entry, source), problems


def _outside(path: Path, real_root: Path) -> Problem:
    return Problem(path, f"resolves to {path.resolve()}, outside the tools directory {real_root}",
                   f"move it into {real_root} instead of linking to it: sandboxes only see that directory")


def shadow_problem(loser: Tool, winner: Tool) -> Problem:
    """Two directories of one root declare the same name: the last by directory name wins."""
    return Problem(loser.manifest.path,
                   f"tool name {loser.name!r} is also declared in {winner.dir.name}/, which wins "
                   "(the last directory by name wins)",
                   "give one of them another 'name:' or remove one of the directories", field="name")


def tool_dirs(root: Path) -> list[Path]:
    """Candidate tool directories of a root: its subdirectories, by name, hidden ones left out."""
    return sorted(path for path in root.iterdir() if not path.name.startswith(".") and path.is_dir())


@dataclass(frozen=True)
class _Parsed:
    key: tuple[int, int, int]  # st_mtime_ns, st_size, st_ino of TOOL.md
    result: tuple[Manifest | None, list[Problem]]


# File timestamps come from a coarse clock (a kernel tick; whole seconds on some
# filesystems), so a change made within this long after a scan may leave every
# timestamp as the scan saw it. A root holding anything changed this recently is
# scanned again at every listing until the window has passed ("racy git").
_RACY_WINDOW_NS = 2_000_000_000
_StatKey = tuple[int, int, int, int, int, int] | None


def _stat_key(path: str) -> _StatKey:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_mode)


# get() (every tools/call) checks the root's entry list and the called tool's own
# files; the rest of the root (another TOOL.md renamed in place to the same name)
# is checked fully at least this often. list() always checks everything.
_FULL_CHECK_INTERVAL_S = 1.0


def _entry_keys(root: str, name: str) -> tuple[_StatKey, ...]:
    """What a scan reads in one entry: TOOL.md and the first of ENTRY_FILES that is a regular file."""
    tool_dir = f"{root}/{name}"
    keys = [_stat_key(f"{tool_dir}/{MANIFEST_FILE}")]
    for entry in ENTRY_FILES:
        key = _stat_key(f"{tool_dir}/{entry}")
        keys.append(key)
        if key is not None and stat.S_ISREG(key[5]):
            break
    return tuple(keys)


@dataclass(frozen=True)
class _Fingerprint:
    """What a scan of a root depends on, in stat results.

    Adding, removing or renaming an entry changes the root's mtime. The files' own
    stats (links followed) show an edit in place, a replacement, a file that appears
    or goes, and a dangling link whose target appears. (Not seen: a dangling link to
    a directory whose target appears empty, which changes only a diagnostic.)
    """

    root: _StatKey
    entries: dict[str, tuple[_StatKey, ...]]

    @classmethod
    def take(cls, root: str, names: list[str]) -> _Fingerprint:
        return cls(_stat_key(root), {name: _entry_keys(root, name) for name in names})

    def racy(self, scanned_at_ns: int) -> bool:
        limit = scanned_at_ns - _RACY_WINDOW_NS
        keys = [self.root, *(key for keys in self.entries.values() for key in keys)]
        return any(key is not None and max(key[3], key[4]) >= limit for key in keys)


@dataclass(eq=False)
class _Snapshot:
    """The last full scan of a root, trusted while the root's fingerprint is unchanged."""

    fingerprint: _Fingerprint
    racy: bool
    tools: list[Tool]
    skipped: list[Skipped]
    by_name: dict[str, Tool]
    verified_at: float  # time.monotonic() of the last full check that held

    def unchanged(self, root: Path) -> bool:
        return _Fingerprint.take(str(root), list(self.fingerprint.entries)) == self.fingerprint

    def holds_for(self, root: Path, name: str) -> bool:
        """The cheap check behind get(): the root's entry list, and the files of the tool called ``name``."""
        if _stat_key(str(root)) != self.fingerprint.root:
            return False
        tool = self.by_name.get(name)
        return tool is None or _entry_keys(str(root), tool.dir.name) == self.fingerprint.entries.get(tool.dir.name)


class ToolCatalog:
    """The tools a user can call. Synchronous; a lock keeps the caches consistent across threads."""

    def __init__(self, data_path: Path) -> None:
        self.data_path = Path(data_path)
        self._lock = threading.Lock()
        # Per root, so a root's entries can be dropped when its directories go.
        self._parsed: dict[Path, dict[Path, _Parsed]] = {}
        self._tools: dict[Path, dict[Path, Tool]] = {}  # kept so a Tool's cached schema survives listings
        self._snapshots: dict[Path, _Snapshot] = {}
        self._roots_by_user: dict[str | None, list[tuple[Path, Source]]] = {}

    def list(self, user: str | None = None) -> list[Tool]:
        """The user's tools (global ones when user is None), sorted by name; user tools override global ones."""
        return self.scan(user)[0]

    def get(self, name: str, user: str | None = None) -> Tool | None:
        """One tool as list() would have it; every tools/call looks its tool up here."""
        for root, source in reversed(self._roots(user)):  # the user's tools override global ones
            tool = self._snapshot(root, source, wanted=name).by_name.get(name)
            if tool is not None:
                return tool
        return None

    def scan(self, user: str | None = None) -> tuple[list[Tool], list[Skipped]]:
        """The tools as in list(), and the directories that are not usable tools, with why."""
        by_name: dict[str, Tool] = {}
        skipped: list[Skipped] = []
        for root, source in self._roots(user):
            snapshot = self._snapshot(root, source)
            by_name.update(snapshot.by_name)
            skipped.extend(snapshot.skipped)
        return sorted(by_name.values(), key=lambda tool: tool.name), skipped

    def _roots(self, user: str | None) -> list[tuple[Path, Source]]:
        roots = self._roots_by_user.get(user)
        if roots is None:
            roots = [(global_tools_dir(self.data_path), "global")]
            if user is not None:
                roots.append((user_tools_dir(self.data_path, check_user(user)), "user"))
            self._roots_by_user[user] = roots
        return roots

    def _snapshot(self, root: Path, source: Source, *, wanted: str | None = None) -> _Snapshot:
        """The root's tools: the last scan while its fingerprint holds, else a new scan."""
        with self._lock:
            snapshot = self._snapshots.get(root)
            if snapshot is not None and not snapshot.racy:
                now = time.monotonic()
                if wanted is not None and now - snapshot.verified_at < _FULL_CHECK_INTERVAL_S:
                    if snapshot.holds_for(root, wanted):
                        return snapshot
                elif snapshot.unchanged(root):
                    snapshot.verified_at = now
                    return snapshot
            # The fingerprint is taken before the scan: a change made during it shows at the next listing.
            scanned_at = time.time_ns()
            try:
                names = sorted(name for name in os.listdir(root) if not name.startswith("."))
            except OSError:
                names = []
            fingerprint = _Fingerprint.take(str(root), names)
            tools, skipped = self._scan_root_fully(root, source)
            snapshot = _Snapshot(fingerprint, fingerprint.racy(scanned_at), tools, skipped,
                                 {tool.name: tool for tool in tools}, time.monotonic())
            self._snapshots[root] = snapshot
            return snapshot

    def _scan_root_fully(self, root: Path, source: Source) -> tuple[list[Tool], list[Skipped]]:
        try:
            candidates = tool_dirs(root)
        except FileNotFoundError:
            self._parsed.pop(root, None)
            self._tools.pop(root, None)
            return [], []
        except OSError as exc:
            problem = Problem(root, f"cannot list the tools directory: {exc.strerror}",
                              "make it a directory the daemon can read")
            return [], [Skipped(root, source, [problem])]

        previous_parsed, previous_tools = self._parsed.get(root, {}), self._tools.get(root, {})
        parsed: dict[Path, _Parsed] = {}
        tools: dict[Path, Tool] = {}

        def parse_cached(manifest_path: Path, within: Path) -> tuple[Manifest | None, list[Problem]]:
            try:
                info = manifest_path.stat()
            except OSError:
                return _parse(manifest_path, within)  # gone or unreadable: let the parser say so
            key = (info.st_mtime_ns, info.st_size, info.st_ino)
            cached = previous_parsed.get(manifest_path)
            if cached is None or cached.key != key:
                cached = _Parsed(key, _parse(manifest_path, within))
            parsed[manifest_path] = cached
            return cached.result

        by_name: dict[str, Tool] = {}
        skipped: list[Skipped] = []
        for tool_dir in candidates:
            tool, problems = inspect_tool_dir(tool_dir, root, source, parse=parse_cached)
            if tool is None:
                skipped.append(Skipped(tool_dir, source, [p for p in problems if p.is_error]))
                continue
            tool = _same_or(previous_tools.get(tool_dir), tool)
            tools[tool_dir] = tool
            if tool.name in by_name:
                loser = by_name[tool.name]
                skipped.append(Skipped(loser.dir, source, [shadow_problem(loser, tool)]))
            by_name[tool.name] = tool
        self._parsed[root], self._tools[root] = parsed, tools
        return list(by_name.values()), skipped


def _same_or(cached: Tool | None, fresh: Tool) -> Tool:
    return cached if cached is not None and cached == fresh else fresh
