"""Finding tools: global ones in DATA_PATH/tools, then the user's in DATA_PATH/<user>/tools.

Every listing looks at the disk again, so a tool that is added, edited or
removed is seen at once without a restart; parsed manifests are cached by the
identity of their TOOL.md (path, mtime, size, inode), so listing an unchanged
tree re-parses nothing.

Sandboxes mount only the tools roots, and the daemon reads TOOL.md on the host:
a tool directory, TOOL.md or entry file that resolves outside its root is
refused rather than followed.
"""

from __future__ import annotations

import copy
import os
import threading
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
                   f"give one of them another 'name:' or remove one of the directories", field="name")


def tool_dirs(root: Path) -> list[Path]:
    """Candidate tool directories of a root: its subdirectories, by name, hidden ones left out."""
    return sorted(path for path in root.iterdir() if not path.name.startswith(".") and path.is_dir())


@dataclass(frozen=True)
class _Parsed:
    key: tuple[int, int, int]  # st_mtime_ns, st_size, st_ino of TOOL.md
    result: tuple[Manifest | None, list[Problem]]


class ToolCatalog:
    """The tools a user can call. Synchronous; a lock keeps the caches consistent across threads."""

    def __init__(self, data_path: Path) -> None:
        self.data_path = Path(data_path)
        self._lock = threading.Lock()
        # Per root, so a root's entries can be dropped when its directories go.
        self._parsed: dict[Path, dict[Path, _Parsed]] = {}
        self._tools: dict[Path, dict[Path, Tool]] = {}  # kept so a Tool's cached schema survives listings

    def list(self, user: str | None = None) -> list[Tool]:
        """The user's tools (global ones when user is None), sorted by name; user tools override global ones."""
        return self.scan(user)[0]

    def get(self, name: str, user: str | None = None) -> Tool | None:
        return next((tool for tool in self.list(user) if tool.name == name), None)

    def scan(self, user: str | None = None) -> tuple[list[Tool], list[Skipped]]:
        """The tools as in list(), and the directories that are not usable tools, with why."""
        roots: list[tuple[Path, Source]] = [(global_tools_dir(self.data_path), "global")]
        if user is not None:
            roots.append((user_tools_dir(self.data_path, check_user(user)), "user"))
        by_name: dict[str, Tool] = {}
        skipped: list[Skipped] = []
        for root, source in roots:
            tools, root_skipped = self._scan_root(root, source)
            by_name.update((tool.name, tool) for tool in tools)
            skipped.extend(root_skipped)
        return sorted(by_name.values(), key=lambda tool: tool.name), skipped

    def _scan_root(self, root: Path, source: Source) -> tuple[list[Tool], list[Skipped]]:
        with self._lock:
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
