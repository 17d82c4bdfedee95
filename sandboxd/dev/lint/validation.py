"""`sandboxd validate`'s checks, without the command: the tools at a path, each tool directory
(manifest, entry code, forgotten version bumps), and a directory of tools as the daemon would
list it. `sandboxd run` checks the tool it runs with the same ``validate_tool_dir``."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from sandboxd.dev.lint.entry import check_entry_file
from sandboxd.dev.lint.permissions import check_permissions_file
from sandboxd.dev.lint.synced import check_synced_copy
from sandboxd.tools.discovery import (
    ENTRY_FILES,
    MAX_ENTRIES_PER_ROOT,
    MAX_ROOT_MANIFEST_BYTES,
    Tool,
    inspect_tool_dir,
    shadow_problem,
    tool_dirs,
)
from sandboxd.tools.manifest import MANIFEST_FILE, parse_manifest
from sandboxd.tools.problem import Problem


def validate_paths(paths: Iterable[Path], data_path: Path | None = None, required: bool = False) -> list[Problem]:
    """Every problem of the tools at these paths: tool directories, TOOL.md files or directories of tools.

    With ``data_path``, each tool is also compared with its synced copy in DATA_PATH/tools;
    ``required`` (tools.require_permissions) holds a tool without a permissions block to nothing.
    """
    problems: list[Problem] = []
    for path in map(Path, paths):
        if not path.exists():
            problems.append(Problem(path, "does not exist",
                                    "pass a tool directory, a TOOL.md file or a directory of tools"))
        elif path.is_file():
            problems.extend(parse_manifest(path)[1])
        elif _is_tool_dir(path):
            problems.extend(validate_tool_dir(path, root=path.parent, data_path=data_path, required=required)[1])
        else:
            problems.extend(_validate_root(path, data_path, required))
    return problems


def validate_tool_dir(tool_dir: Path, root: Path, data_path: Path | None = None,
                      required: bool = False) -> tuple[Tool | None, list[Problem]]:
    """One tool directory: its manifest, its entry file's code (with what it uses against its permissions
    block), and (with ``data_path``) its synced copy.

    The tool is None when its manifest or files make it unusable; code findings are reported but,
    like the loader, discovery does not look at the code.
    """
    tool, problems = inspect_tool_dir(tool_dir, root, "global")
    entry = next((tool_dir / name for name in ENTRY_FILES if (tool_dir / name).is_file()), None)
    if entry is not None:
        problems.extend(check_entry_file(entry))
        if tool is not None:
            problems.extend(check_permissions_file(entry, tool.permissions, required))
    if tool is not None and data_path is not None:
        problems.extend(check_synced_copy(tool_dir, data_path))
    return tool, problems


def _validate_root(root: Path, data_path: Path | None = None, required: bool = False) -> list[Problem]:
    candidates = tool_dirs(root)
    if not candidates:
        return [Problem(root, f"holds no {MANIFEST_FILE} and no tool directories",
                        f"add {MANIFEST_FILE} and index.ts here, or pass a tool directory or a directory of tools")]
    problems = _root_bounds(root, candidates)
    by_name: dict[str, Tool] = {}
    for tool_dir in candidates:
        tool, tool_problems = validate_tool_dir(tool_dir, root, data_path, required)
        problems.extend(tool_problems)
        if tool is not None:
            if tool.name in by_name:
                problems.append(shadow_problem(by_name[tool.name], tool))
            by_name[tool.name] = tool
    return problems


def _root_bounds(root: Path, candidates: list[Path]) -> list[Problem]:
    """Warnings where the daemon, listing this directory as a tools root, would skip tools."""
    problems = []
    if len(candidates) > MAX_ENTRIES_PER_ROOT:
        problems.append(Problem(root, f"holds {len(candidates)} tools; the daemon reads the first "
                                      f"{MAX_ENTRIES_PER_ROOT} entries by name and skips the rest",
                                "split the tools between the global and the user's tools directories, or remove some",
                                severity="warning"))
    manifests = [tool_dir / MANIFEST_FILE for tool_dir in candidates]
    total = sum(path.stat().st_size for path in manifests if path.is_file())
    if total > MAX_ROOT_MANIFEST_BYTES:
        problems.append(Problem(root, f"its TOOL.md files add up to {total} bytes; the daemon reads "
                                      f"{MAX_ROOT_MANIFEST_BYTES} bytes of them and skips the tools after that",
                                "shorten the TOOL.md files (move long material out of them) or remove tools",
                                severity="warning"))
    return problems


def _is_tool_dir(path: Path) -> bool:
    return any((path / name).exists() for name in (MANIFEST_FILE, *ENTRY_FILES))
