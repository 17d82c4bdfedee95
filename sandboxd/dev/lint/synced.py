"""The synced-copy check: a tool edited in the tools directory but not yet synced to
DATA_PATH/tools (a forgotten version bump) runs as the old copy."""

from __future__ import annotations

import filecmp
import os
import re
from pathlib import Path

from sandboxd.tools.discovery import ENTRY_FILES
from sandboxd.tools.manifest import MANIFEST_FILE, read_version
from sandboxd.tools.problem import Problem


MAX_COMPARED_FILES = 2000  # beyond this, only TOOL.md and the entry files are compared


def check_synced_copy(tool_dir: Path, data_path: Path) -> list[Problem]:
    """"Bump version": the tool differs from its synced copy in DATA_PATH/tools, which sync will keep.

    Sync copies a seed tool only when its version is higher than the installed
    one's (docs/tools.md, "Sync"), so an edit without a bump never arrives.
    Tools inside DATA_PATH (the synced copies themselves, users' own tools) are
    not synced and not checked.
    """
    data_path = Path(data_path).resolve()
    real_dir = Path(tool_dir).resolve()
    installed = data_path / "tools" / real_dir.name
    if real_dir.is_relative_to(data_path) or not installed.is_dir():
        return []
    manifest = real_dir / MANIFEST_FILE
    version, installed_version = read_version(manifest), read_version(installed / MANIFEST_FILE)
    if version > installed_version or _same_tree(real_dir, installed):
        return []
    line = _version_line(manifest)
    if version == installed_version:
        message = (f"this tool differs from its synced copy in {installed} but has the same version {version}, "
                   "so sync keeps the old copy and the agent never sees the change")
    else:
        message = (f"the synced copy in {installed} has version {installed_version}, higher than this tool's "
                   f"{version}, so sync never replaces it")
    return [Problem(tool_dir / MANIFEST_FILE, message, f"bump the version: 'version: {installed_version + 1}'",
                    field="version", line=line)]


def _version_line(manifest: Path) -> int | None:
    try:
        lines = manifest.read_text(encoding="utf-8-sig", errors="replace").splitlines()
    except OSError:
        return None
    return next((n for n, text in enumerate(lines[1:], start=2) if re.match(r"version\s*:", text)), None)


def _tree(root: Path) -> dict[str, Path] | None:
    """Relative path → path of every file and link under ``root``; None when there are too many."""
    found: dict[str, Path] = {}
    for directory, dirs, files in os.walk(root):
        base = Path(directory)
        for name in files + [d for d in dirs if (base / d).is_symlink()]:
            found[str((base / name).relative_to(root))] = base / name
            if len(found) > MAX_COMPARED_FILES:
                return None
    return found


def _same_tree(left: Path, right: Path) -> bool:
    left_files, right_files = _tree(left), _tree(right)
    if left_files is None or right_files is None:
        names = (MANIFEST_FILE, *ENTRY_FILES)
        left_files = {n: left / n for n in names if os.path.lexists(left / n)}
        right_files = {n: right / n for n in names if os.path.lexists(right / n)}
    if left_files.keys() != right_files.keys():
        return False
    for name, path in left_files.items():
        other = right_files[name]
        if path.is_symlink() or other.is_symlink():
            if not (path.is_symlink() and other.is_symlink() and os.readlink(path) == os.readlink(other)):
                return False
        elif not filecmp.cmp(path, other, shallow=False):
            return False
    return True
