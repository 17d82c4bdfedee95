"""Reading a TOOL.md safely (a user's file: never a FIFO, a device or a file out of the tools
directory; bounded in bytes) and splitting its frontmatter from its body."""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import yaml

from sandboxd.tools.manifest.model import MAX_FRONTMATTER_BYTES, MAX_MANIFEST_BYTES
from sandboxd.tools.problem import Problem
from sandboxd.tools.yaml12 import ManifestLoader

FENCE_RE = re.compile(r"^---[ \t]*$")


def read_version(path: Path) -> int:
    """The frontmatter's version, 0 when it is missing or invalid (the rule sync follows)."""
    text, problem = read_manifest_file(Path(path), None)
    if problem is not None:
        return 0
    frontmatter = split_frontmatter(normalise(text))
    if frontmatter is None or not frontmatter.closed or len(frontmatter.yaml) > MAX_FRONTMATTER_BYTES:
        return 0
    try:
        data = yaml.load(frontmatter.yaml, Loader=ManifestLoader)  # noqa: S506 - a safe loader
    except (yaml.YAMLError, ValueError, OverflowError, RecursionError):
        return 0
    version = data.get("version") if isinstance(data, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else 0


def read_manifest_file(path: Path, within: Path | None) -> tuple[str, Problem | None]:
    def problem(message: str, fix: str, line: int | None = None) -> tuple[str, Problem]:
        return "", Problem(path, message, fix, line=line)

    try:
        # O_PATH resolves the name without opening what it names: a FIFO, a device
        # (opening some has effects) or a file out of the root is looked at, never opened.
        handle = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return problem(f"{path.name} does not exist", "create it with name, description and version frontmatter")
    except OSError as exc:
        return problem(f"cannot open {path.name}: {exc.strerror}", "make the file readable by the daemon")
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode):
            return problem(f"{path.name} is not a regular file", "replace it with a plain text file")
        if within is not None:
            # Check the file actually opened, so a symlink swapped after any earlier check cannot slip through.
            # The root's own last component is not followed: discovery passes it already resolved.
            within = Path(within)
            real, root = _opened_path(handle, path), Path(os.path.realpath(within.parent)) / within.name
            if not real.is_relative_to(root):
                return problem(f"{path.name} resolves to {real}, outside the tools directory {root}",
                               f"put a real {path.name} inside {root} instead of a symlink out of it")
        if info.st_size > MAX_MANIFEST_BYTES:
            return problem(f"{path.name} is {info.st_size} bytes, over the limit of {MAX_MANIFEST_BYTES}",
                           "move long material into other files and keep TOOL.md to metadata and usage")
        try:
            # The very file checked above (the handle, not the name again); O_NONBLOCK as a last guard.
            fd = os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            return problem(f"cannot open {path.name}: {exc.strerror}", "make the file readable by the daemon")
    finally:
        os.close(handle)
    with open(fd, "rb", closefd=True) as file:
        data = file.read(MAX_MANIFEST_BYTES + 1)
    try:
        return data.decode("utf-8"), None
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return problem(f"{path.name} is not UTF-8 text (byte {exc.start})", "save the file as UTF-8", line)


def _opened_path(fd: int, path: Path) -> Path:
    try:
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # no /proc: fall back to resolving the name
        return path.resolve()


@dataclass(frozen=True)
class _Frontmatter:
    yaml: str
    body: str
    closed: bool


def normalise(text: str) -> str:
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def split_frontmatter(text: str) -> _Frontmatter | None:
    lines = text.split("\n")
    if not FENCE_RE.match(lines[0]):
        return None
    for index in range(1, len(lines)):
        if FENCE_RE.match(lines[index]):
            return _Frontmatter("\n".join(lines[1:index]), "\n".join(lines[index + 1:]), closed=True)
    return _Frontmatter("\n".join(lines[1:]), "", closed=False)
