"""Finding tools: global ones in DATA_PATH/tools, then the user's in DATA_PATH/<user>/tools.

Every listing looks at the disk again, so a tool that is added, edited or
removed is seen at once without a restart; parsed manifests are cached by the
identity of their TOOL.md (path, mtime, size, inode), so listing an unchanged
tree re-parses nothing. Every tools/call looks its tool up this way: a root no
inotify event touched since its scan (inotify.py), or else whose fingerprint (a stat
of the root, of each entry in it, of its TOOL.md and entry file) is unchanged,
answers from the last scan, instead of a walk with realpath checks (CHANGELOG.md, 2026-12-01).

Sandboxes mount only the tools roots, and the daemon reads TOOL.md on the host:
a tool directory, TOOL.md or entry file that resolves outside its root is
refused rather than followed, and a user's tools root that is a symbolic link
is refused as a whole (a sandbox can write DATA_PATH/<user>/).

A user's tools root is hostile input. The daemon never scans on its event loop:
list_async/refresh run scans in a small worker pool (one scan per root at a time,
per-root locks, so one user's root never holds up another's), and lookup() answers
a tools/call from the last scan, with one read of the inotify queue or a few stat calls. A scan
is bounded: MAX_ENTRIES_PER_ROOT entries, MAX_ROOT_MANIFEST_BYTES of TOOL.md,
ROOT_SCAN_TIME_LIMIT_S; a tools/list answer holds at most MAX_LIST_BYTES. What is
over a bound is skipped with a Problem, never silently.
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable

from sandboxd.logging import get_logger
from sandboxd.tools import freshness
from sandboxd.tools.inotify import RootWatcher
from sandboxd.tools.manifest import MANIFEST_FILE, Manifest, parse_manifest
from sandboxd.tools.problem import Problem
from sandboxd.tools.tool import ENTRY_FILES, Skipped, Source, Tool
from sandboxd.users import check_user, global_tools_dir, user_tools_dir

log = get_logger("sandboxd.tools")

MAX_ENTRIES_PER_ROOT = 256  # entries of one tools root read (by name); the rest is skipped with a problem
MAX_ROOT_MANIFEST_BYTES = 2 << 20  # TOOL.md bytes of one root; the tools past it are skipped
ROOT_SCAN_TIME_LIMIT_S = 5.0  # a scan parses nothing more after this; the rest is retried at the next one
MAX_LIST_BYTES = 8 << 20  # of a tools/list answer (JSON); tools past it are skipped, by name
ParseFn = Callable[[Path, Path], tuple[Manifest | None, list[Problem]]]


def _parse(manifest_path: Path, root: Path) -> tuple[Manifest | None, list[Problem]]:
    return parse_manifest(manifest_path, within=root)  # looked up at call time, so tests can count parses


def inspect_tool_dir(tool_dir: Path, root: Path, source: Source,
                     parse: ParseFn = _parse) -> tuple[Tool | None, list[Problem]]:
    """The tool in ``tool_dir`` (None if unusable) and every problem found, warnings included."""
    real_root = _real_root(root, source)
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
        manifest, manifest_problems = parse(manifest_path, real_root)
        problems.extend(manifest_problems)
    else:
        problems.append(Problem(tool_dir, f"no {MANIFEST_FILE}",
                                f"add {MANIFEST_FILE} with name, description and version frontmatter"))

    if manifest is None or entry is None or any(p.is_error for p in problems):
        return None, problems
    return Tool(manifest, tool_dir, entry, source), problems


def _real_root(root: Path, source: Source) -> Path:
    """What files must resolve within. A user's root is never followed if it is a link (the
    scan refuses one, and this also holds if a sandbox swaps one in during the scan)."""
    return root.resolve() if source == "global" else root.parent.resolve() / root.name


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


class ScanNeeded(Exception):
    """lookup() cannot answer from the last scan: refresh() first (off the event loop)."""


def _user_root_problem(root: Path) -> Problem | None:
    """Why a user's tools root is refused (a link or not a directory), or None: no tools are read from it."""
    try:
        info = os.lstat(root)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Problem(root, f"cannot read the user's tools directory: {exc.strerror}",
                       "make it a directory the daemon can read")
    if stat.S_ISLNK(info.st_mode):
        return Problem(root, "the user's tools directory is a symbolic link, so none of its tools are listed "
                             "(a sandbox can write the user's directory and could point it anywhere)",
                       f"replace the link with a real directory: rm {root} && mkdir {root}")
    if not stat.S_ISDIR(info.st_mode):
        return Problem(root, "the user's tools directory is not a directory, so no user tools are listed",
                       f"remove it and create a directory: rm {root} && mkdir {root}")
    return None


@dataclass(frozen=True)
class _Parsed:
    key: tuple[int, int, int]  # st_mtime_ns, st_size, st_ino of TOOL.md
    result: tuple[Manifest | None, list[Problem]]


# get() (every tools/call) checks the root's entry list and the called tool's own
# files; the rest of the root (another TOOL.md renamed in place to the same name)
# is checked fully at least this often. tools() always checks everything.
_FULL_CHECK_INTERVAL_S = 1.0

_SCAN_WORKERS = 4  # one scan per root at a time, so one hostile root takes at most one of these
_MAX_CACHED_USERS = 10_000
_MAX_CACHED_ROOTS = 10_000  # past this, the scans of empty roots are forgotten (cheap to redo)


class ToolCatalog:
    """The tools a user can call.

    list/get/scan scan on the calling thread (the CLI, tests). The daemon uses
    list_async/refresh, which scan in worker threads, and lookup, which never scans.
    """

    def __init__(self, data_path: Path, *, on_global_change: Callable[[], None] | None = None) -> None:
        self.data_path = Path(data_path)
        # Told (from a scan's thread) when a scan finds the global tools changed: the transpile cache refills.
        self.on_global_change = on_global_change
        self._locks_lock = threading.Lock()
        self._root_locks: dict[Path, threading.Lock] = {}
        # Per root, so a root's entries can be dropped when its directories go.
        self._parsed: dict[Path, dict[Path, _Parsed]] = {}
        self._tools: dict[Path, dict[Path, Tool]] = {}  # kept so a Tool's cached schema survives listings
        self._snapshots: dict[Path, freshness.Snapshot] = {}
        self._stored = 0  # grows whenever a snapshot is dropped (under _locks_lock: scans drop them from threads)
        self._routes: dict[str | None, tuple[tuple[int, int], dict[str, Tool]]] = {}  # per user: _route()
        self._roots_by_user: dict[str | None, list[tuple[Path, Source]]] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._inflight: dict[Path, asyncio.Future[freshness.Snapshot]] = {}  # used on the event loop only
        # Tells lookup() which roots changed since their scan without stat calls; None: stat them.
        self._watcher = RootWatcher.create((MANIFEST_FILE, *ENTRY_FILES))

    # -- synchronous: scans on the calling thread ---------------------------------------------

    def tools(self, user: str | None = None) -> list[Tool]:
        """The user's tools (global ones when user is None), sorted by name; user tools override global ones."""
        return self.scan(user)[0]

    def get(self, name: str, user: str | None = None) -> Tool | None:
        """One tool as tools() would have it."""
        for root, source in reversed(self._roots(user)):  # the user's tools override global ones
            tool = self._snapshot(root, source, wanted=name).by_name.get(name)
            if tool is not None:
                return tool
        return None

    def scan(self, user: str | None = None) -> tuple[list[Tool], list[Skipped]]:
        """The tools as in tools(), and the directories that are not usable tools, with why."""
        return _merge([self._snapshot(root, source) for root, source in self._roots(user)])

    # -- for the event loop ---------------------------------------------------------------------

    def lookup(self, name: str, user: str | None, *, since: float) -> Tool | None:
        """get() from the last scans, with stat checks only; ScanNeeded when one must be scanned again.

        A scan that started at or after ``since`` (when the request arrived) is trusted as it is.
        """
        if (route := self._route(user)) is not None:
            return route.get(name)
        roots = self._roots(user)
        # One read of the inotify queue for all of the user's roots.
        clean = self._watcher.clean(root for root, _ in roots) if self._watcher is not None else ()
        for root, _ in reversed(roots):
            snapshot = self._trusted(root, name, since, watched_clean=root in clean)
            if snapshot is None:
                raise ScanNeeded(root)
            tool = snapshot.by_name.get(name)
            if tool is not None:
                return tool
        return None

    def _route(self, user: str | None) -> dict[str, Tool] | None:
        """The user's tools by name while each of their roots is watched, untouched and not racy (what
        lookup() trusts for any name and request), else None; one read of the queue while nothing changed."""
        if self._watcher is None:
            return None
        version = (self._watcher.version(), self._stored)  # read before what they vouch for
        route = self._routes.get(user)
        if route is not None and route[0] == version:
            return route[1]
        roots = self._roots(user)
        if len(self._watcher.clean(root for root, _ in roots)) < len(roots):
            return None
        by_name: dict[str, Tool] = {}
        for root, _ in roots:  # the user's tools override the global ones
            snapshot = self._snapshots.get(root)
            if snapshot is None or snapshot.racy:
                return None
            by_name.update(snapshot.by_name)
        if len(self._routes) >= _MAX_CACHED_USERS:
            self._routes.clear()  # a client naming endless users must not grow this forever
        self._routes[user] = (version, by_name)
        return by_name

    def known_names(self, user: str | None) -> list[str]:
        """The tool names of the last scans, for an "unknown tool" message (no checks, no scan)."""
        names: set[str] = set()
        for root, _ in self._roots(user):
            snapshot = self._snapshots.get(root)
            if snapshot is not None:
                names.update(snapshot.by_name)
        return sorted(names)

    async def refresh(self, user: str | None, *, since: float) -> None:
        """Scan, in a worker, each of the user's roots that lookup(since=since) would not trust."""
        for root, source in self._roots(user):
            await self._snapshot_async(root, source, since)

    async def scan_async(self, user: str | None = None) -> tuple[list[Tool], list[Skipped]]:
        """scan(), with every scan in a worker thread."""
        since = time.monotonic()
        return _merge([await self._snapshot_async(root, source, since) for root, source in self._roots(user)])

    async def tools_async(self, user: str | None = None) -> list[Tool]:
        return (await self.scan_async(user))[0]

    def roots(self, user: str | None) -> list[tuple[Path, Source]]:
        """The tools roots a user's listing reads: the global one, then the user's own."""
        return list(self._roots(user))

    def fingerprint(self, root: Path, source: Source) -> Any:
        """What a scan of ``root`` would depend on, by stat calls only (nothing is parsed).

        Equal to an earlier one unless a tool was added, removed or edited since: tools/watch
        compares them. Runs on the calling thread; the daemon calls it from a worker.
        """
        return freshness.Fingerprint.take(str(root), self._root_entries(root, source)[0])

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.close()
            self._watcher = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _snapshot_async(self, root: Path, source: Source, since: float) -> freshness.Snapshot:
        while True:
            snapshot = self._trusted(root, None, since)
            if snapshot is not None:
                return snapshot
            # Joined by every request for this root meanwhile: a hostile root occupies one worker.
            future = self._inflight.get(root)
            # A done one is still here until its callback runs, and awaiting a done future does
            # not yield: without a fresh scan this loop would spin the event loop forever.
            if future is None or future.done():
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(_SCAN_WORKERS, thread_name_prefix="sandboxd-scan")
                future = asyncio.wrap_future(self._executor.submit(self._scan, root, source, log_skips=True))
                self._inflight[root] = future
                future.add_done_callback(partial(self._scan_done, root))
            snapshot = await asyncio.shield(future)
            if snapshot.scanned_at >= since:
                return snapshot
            # That scan began before this request arrived: loop to check (or scan) again.

    def _scan_done(self, root: Path, future: asyncio.Future[freshness.Snapshot]) -> None:
        if self._inflight.get(root) is future:
            del self._inflight[root]

    # -- snapshots ------------------------------------------------------------------------------

    def _roots(self, user: str | None) -> list[tuple[Path, Source]]:
        roots = self._roots_by_user.get(user) if isinstance(user, (str, type(None))) else None
        if roots is None:
            roots = [(global_tools_dir(self.data_path), "global")]
            if user is not None:
                roots.append((user_tools_dir(self.data_path, check_user(user)), "user"))
            if len(self._roots_by_user) >= _MAX_CACHED_USERS:
                self._roots_by_user.clear()  # a client naming endless users must not grow this forever
            self._roots_by_user[user] = roots
        return roots

    def _trusted(self, root: Path, wanted: str | None, since: float | None, *,
                 watched_clean: bool = False) -> freshness.Snapshot | None:
        """The root's last scan if the cheap stat checks say it still holds, else None.
        ``watched_clean``: the watcher says no event touched ``root`` since its scan."""
        snapshot = self._snapshots.get(root)
        if snapshot is None:
            return None
        if since is not None and snapshot.scanned_at >= since:
            return snapshot
        if snapshot.racy:
            return None
        if wanted is not None and watched_clean:
            return snapshot  # watched since its scan and no event touched it; else the stat checks decide
        now = time.monotonic()
        if wanted is not None and now - snapshot.verified_at < _FULL_CHECK_INTERVAL_S:
            return snapshot if snapshot.holds_for(root, wanted) else None
        if snapshot.unchanged(root):
            snapshot.verified_at = now
            return snapshot
        return None

    def _snapshot(self, root: Path, source: Source, *, wanted: str | None = None) -> freshness.Snapshot:
        """The root's tools: the last scan while its fingerprint holds, else a new scan."""
        watched_clean = wanted is not None and self._watcher is not None and self._watcher.unchanged(root)
        return self._trusted(root, wanted, None, watched_clean=watched_clean) or self._scan(root, source)

    def _root_lock(self, root: Path) -> threading.Lock:
        with self._locks_lock:
            return self._root_locks.setdefault(root, threading.Lock())

    def _scan(self, root: Path, source: Source, *, log_skips: bool = False) -> freshness.Snapshot:
        asked_at = time.monotonic()
        with self._root_lock(root):
            previous = self._snapshots.get(root)
            if previous is not None and previous.scanned_at >= asked_at:
                return previous  # another thread scanned it while this one waited for the lock
            # The fingerprint is taken before the scan: a change made during it shows at the next listing.
            scanned_at, scanned_at_ns = time.monotonic(), time.time_ns()
            names, problems = self._root_entries(root, source)
            if self._watcher is not None:
                self._arm(root, source, names)
            fingerprint = freshness.Fingerprint.take(str(root), names)
            tools, skipped, complete = self._scan_root_fully(root, source, names)
            if problems:
                skipped.insert(0, Skipped(root, source, problems))
            snapshot = freshness.Snapshot(fingerprint, not complete or fingerprint.racy(scanned_at_ns), tools, skipped,
                                 {tool.name: tool for tool in tools}, time.monotonic(), scanned_at)
            if log_skips:  # the daemon's scans: the operator's log says why a tool is not offered
                _log_new_skips(previous, snapshot)
            self._snapshots[root] = snapshot
            if (source == "global" and self.on_global_change is not None
                    and (previous is None or previous.fingerprint != fingerprint)):
                self.on_global_change()
            if len(self._snapshots) > _MAX_CACHED_ROOTS:
                self._forget_empty_roots(keep=root)
            return snapshot

    def _arm(self, root: Path, source: Source, names: list[str]) -> None:
        """Watch what this scan reads before it reads it; listed again, so an entry added meanwhile is not missed."""
        assert self._watcher is not None
        with self._locks_lock:  # armed, the root is clean before this scan reads it: its last scan is trusted no more
            self._snapshots.pop(root, None)
            self._stored += 1
        if self._watcher.arm(root, [root / name for name in names if (root / name).is_dir()], stop_at=self.data_path) \
                and self._root_entries(root, source)[0] != names:
            self._watcher.forget(root)

    def _forget_empty_roots(self, keep: Path) -> None:
        """A client naming endless users (each a root without tools) must not grow the caches forever."""
        for root in [root for root, snapshot in self._snapshots.items()
                     if root != keep and not snapshot.tools and not snapshot.skipped]:
            if self._watcher is not None:
                self._watcher.forget(root)
            with self._locks_lock:
                self._snapshots.pop(root, None)
                self._stored += 1
                self._root_locks.pop(root, None)

    def _root_entries(self, root: Path, source: Source) -> tuple[list[str], list[Problem]]:
        """The names a scan reads (at most MAX_ENTRIES_PER_ROOT), and problems with the root itself."""
        if source == "user":
            refused = _user_root_problem(root)
            if refused is not None:
                return [], [refused]
        try:
            names = sorted(name for name in os.listdir(root) if not name.startswith("."))
        except FileNotFoundError:
            return [], []
        except OSError as exc:
            return [], [Problem(root, f"cannot list the tools directory: {exc.strerror}",
                                "make it a directory the daemon can read")]
        if len(names) <= MAX_ENTRIES_PER_ROOT:
            return names, []
        left_out = names[MAX_ENTRIES_PER_ROOT:]
        return names[:MAX_ENTRIES_PER_ROOT], [Problem(
            root, f"holds {len(names)} entries; only the first {MAX_ENTRIES_PER_ROOT} by name are read, so "
                  f"{', '.join(left_out[:5])}{', ...' if len(left_out) > 5 else ''} are skipped",
            f"remove tools and other files until at most {MAX_ENTRIES_PER_ROOT} remain")]

    def _scan_root_fully(self, root: Path, source: Source,
                         names: list[str]) -> tuple[list[Tool], list[Skipped], bool]:
        """The root's tools and skipped directories, and whether every manifest could be read."""
        if not names:
            self._parsed.pop(root, None)
            self._tools.pop(root, None)
            return [], [], True
        candidates = [root / name for name in names if (root / name).is_dir()]
        previous_parsed, previous_tools = self._parsed.get(root, {}), self._tools.get(root, {})
        parsed: dict[Path, _Parsed] = {}
        tools: dict[Path, Tool] = {}
        deadline = time.monotonic() + ROOT_SCAN_TIME_LIMIT_S
        budget = {"bytes": MAX_ROOT_MANIFEST_BYTES, "complete": True}

        def parse_cached(manifest_path: Path, within: Path) -> tuple[Manifest | None, list[Problem]]:
            try:
                info = manifest_path.stat()
            except OSError:
                return _parse(manifest_path, within)  # gone or unreadable: let the parser say so
            if stat.S_ISREG(info.st_mode):
                budget["bytes"] -= info.st_size
                if budget["bytes"] < 0:
                    return None, [Problem(manifest_path, f"the TOOL.md files of {root} add up to more than "
                                                         f"{MAX_ROOT_MANIFEST_BYTES} bytes; this one and the "
                                                         "ones after it (by name) are not read",
                                          "shorten the TOOL.md files or remove tools")]
            key = (info.st_mtime_ns, info.st_size, info.st_ino)
            cached = previous_parsed.get(manifest_path)
            if cached is None or cached.key != key:
                if time.monotonic() > deadline:
                    budget["complete"] = False  # not cached: the next scan tries again
                    return None, [Problem(manifest_path, f"not read: reading {root} took longer than "
                                                         f"{ROOT_SCAN_TIME_LIMIT_S:g} s",
                                          "simplify the TOOL.md files of this directory, or list again")]
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
        return list(by_name.values()), skipped, bool(budget["complete"])


def _log_new_skips(previous: freshness.Snapshot | None, snapshot: freshness.Snapshot) -> None:
    """Tell the operator about each directory skipped for a new reason (a scan repeats the old ones)."""
    seen = {(entry.dir, tuple(map(str, entry.problems))) for entry in previous.skipped} if previous else set()
    for entry in snapshot.skipped:
        problems = tuple(map(str, entry.problems))
        if (entry.dir, problems) not in seen:
            log.warning("tool_skipped", dir=str(entry.dir), source=entry.source, problems=list(problems[:5]))


def _merge(snapshots: Iterable[freshness.Snapshot]) -> tuple[list[Tool], list[Skipped]]:
    """The roots' tools by name, later roots overriding earlier ones, within MAX_LIST_BYTES."""
    by_name: dict[str, Tool] = {}
    skipped: list[Skipped] = []
    for snapshot in snapshots:
        by_name.update(snapshot.by_name)
        skipped.extend(snapshot.skipped)
    tools: list[Tool] = []
    size = 0
    for tool in sorted(by_name.values(), key=lambda tool: tool.name):
        if size + tool.protocol_bytes > MAX_LIST_BYTES:
            skipped.append(Skipped(tool.dir, tool.source, [Problem(
                tool.manifest.path, f"left out of tools/list: with it the answer would exceed {MAX_LIST_BYTES} "
                                    "bytes (the tools before it by name come first)",
                "shorten the documentation of the tools or remove tools", field="name")]))
            continue
        size += tool.protocol_bytes
        tools.append(tool)
    return tools, skipped


def _same_or(cached: Tool | None, fresh: Tool) -> Tool:
    return cached if cached is not None and cached == fresh else fresh
