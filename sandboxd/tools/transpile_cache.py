"""The global tools transpiled once, on the host, for every sandbox to read (CHANGELOG.md, 2026-12-01).

A sandbox's shim transpiles each TypeScript file (and each .js/.mjs of a tool) with
esbuild before Node loads it. Starting esbuild's service costs ~30 ms in every sandbox,
on a new user's first call, and an esbuild process and a worker thread in every idle
sandbox. The global tools are the operator's, so the daemon transpiles them ahead of
need with the image's own esbuild binary (copied out of the image, so the version is the
shim's) and the shim's options, into DATA_PATH/.cache/transpile/<esbuild version>/,
which every sandbox mounts read-only. The shim looks a file up by key (a hash of the
esbuild version, the loader, the file's path in the sandbox and its source: a hit is the
transpile of exactly that source) and starts esbuild only on a miss.

A user's own tools are never transpiled here: their sources are hostile input, and
esbuild on the host would parse them outside any sandbox. They are transpiled in the
user's sandbox as before.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sandboxd.container import CONTAINER_TOOLS
from sandboxd.logging import get_logger
from sandboxd.tools.esbuild import Esbuild

log = get_logger("sandboxd.tools")

CACHE_ENV = "SANDBOXD_TRANSPILE_CACHE"
KEY_PREFIX = "sandboxd-transpile-1"  # images/node/shim/src/loader.js, precompiledKey()
# The shim's loaders (loader.js TS_LOADERS, and .js/.mjs files of a tool's own folder).
LOADERS = {".ts": "ts", ".mts": "ts", ".cts": "ts", ".tsx": "tsx", ".js": "js", ".mjs": "js"}
MAX_FILES = 4096  # of the global tools; the rest is transpiled in the sandbox, as before
MAX_FILE_BYTES = 1 << 20
# Paths the shim and this module spell alike (import.meta.url percent-encodes nothing in them).
_PLAIN_PATH = re.compile(r"[A-Za-z0-9_./-]+")


def cache_dir(data_path: Path, esbuild_version: str) -> Path:
    return data_path / ".cache" / "transpile" / esbuild_version


def transpile_bin_dir(data_path: Path) -> Path:
    """Where the esbuild binary copied out of the image is kept (never mounted into a sandbox)."""
    return data_path / ".cache" / "esbuild"


def key(esbuild_version: str, loader: str, filename: str, source: str) -> str:
    """The cache file's name (without .js) for ``source`` at ``filename`` in a sandbox."""
    digest = hashlib.sha256(f"{KEY_PREFIX}\0{esbuild_version}\0{loader}\0{filename}\0".encode())
    digest.update(source.encode())
    return digest.hexdigest()


def _sources(root: Path) -> list[Path]:
    """The files of the global tools the shim would transpile: by name, no links, no node_modules."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow links to folders
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "node_modules")
        for name in sorted(filenames):
            path = Path(dirpath) / name
            if path.suffix in LOADERS and not name.startswith(".") and not path.is_symlink():
                found.append(path)
                if len(found) >= MAX_FILES:
                    return found
    return found


def _read_source(path: Path) -> str | None:
    """The source as the shim reads it (UTF-8, a leading BOM dropped), or None when not cached."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if len(data) > MAX_FILE_BYTES:
        return None
    try:
        text = data.decode("utf-8")  # invalid UTF-8: Node would replace bytes; leave it to the shim
    except UnicodeDecodeError:
        return None
    return text[1:] if text.startswith("\ufeff") else text


@dataclass
class FillReport:
    written: int = 0
    present: int = 0
    skipped: int = 0
    removed: int = 0  # entries no current source needs, and temporaries a killed daemon left


def fill(root: Path, directory: Path, esbuild: Esbuild, *, container_root: str = CONTAINER_TOOLS) -> FillReport:
    """Transpile every source under ``root`` (the global tools) not yet in ``directory``.

    Entries are written whole (a temporary file renamed into place), so a sandbox reading
    the folder meanwhile sees a file complete or not at all. Then every other file goes: a
    key names one exact source, so an old entry is never wrong, only unused for ever (a tool
    edited or removed since); a shim that still asks for one gets a miss and transpiles.
    """
    report = FillReport()
    kept: set[str] = set()
    directory.mkdir(parents=True, exist_ok=True)
    # Readable by the sandbox uid whatever the daemon's umask: it holds only what /officer/tools shows.
    directory.chmod(0o755)
    for path in _sources(root):
        filename = f"{container_root}/{path.relative_to(root).as_posix()}"
        source = _read_source(path)
        if source is None or not _PLAIN_PATH.fullmatch(filename):
            report.skipped += 1
            continue
        loader = LOADERS[path.suffix]
        target = directory / f"{key(esbuild.version, loader, filename, source)}.js"
        kept.add(target.name)
        if target.exists():
            report.present += 1
            continue
        code = esbuild.transpile(source, loader, filename)
        if code is None:
            report.skipped += 1
            continue
        temporary = directory / f".{target.name}.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            os.fchmod(fd, 0o644)
            file.write(code)
        os.replace(temporary, target)
        report.written += 1
    report.removed = _remove_all_but(directory, kept)
    return report


def _remove_all_but(directory: Path, kept: set[str]) -> int:
    """Unlink every file of ``directory`` (the daemon's own: sandboxes mount it read-only) not in ``kept``."""
    removed = 0
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name not in kept and not entry.is_dir(follow_symlinks=False):
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
    return removed


_VERSION_DIR = re.compile(r"\d+\.\d+\.\d+(?:[-+][0-9A-Za-z.-]+)?")


def remove_other_versions(data_path: Path, esbuild_version: str) -> list[str]:
    """The caches of other esbuild versions (an image since replaced): no shim can hit them any more."""
    parent = cache_dir(data_path, esbuild_version).parent
    removed: list[str] = []
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return removed
    for entry in entries:
        if entry.name != esbuild_version and _VERSION_DIR.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.name)
    return removed


class TranspileCache:
    """Keeps the cache filled from a worker thread: once at start, again whenever asked.

    ``directory`` is None until the first fill is done: a sandbox that starts before then
    gets no cache, and its shim starts esbuild before `ready` as without one.
    """

    def __init__(self, tools_dir: Path, data_path: Path) -> None:
        self.tools_dir = tools_dir
        self.data_path = data_path
        self.directory: Path | None = None
        self._esbuild: Esbuild | None = None
        self._wanted = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def start(self, esbuild: Esbuild) -> None:
        self._esbuild = esbuild
        self._wanted.set()
        self._thread = threading.Thread(target=self._run, name="sandboxd-transpile", daemon=True)
        self._thread.start()

    def request(self) -> None:
        """The global tools may have changed: fill again (thread-safe, coalesced)."""
        self._wanted.set()

    def stop(self) -> None:
        self._stopping = True
        self._wanted.set()

    def _run(self) -> None:
        assert self._esbuild is not None
        directory = cache_dir(self.data_path, self._esbuild.version)
        stale = remove_other_versions(self.data_path, self._esbuild.version)
        if stale:
            log.info("transpile_cache_removed", versions=stale, kept=self._esbuild.version)
        while True:
            self._wanted.wait()
            if self._stopping:
                return
            self._wanted.clear()
            started = time.monotonic()
            try:
                report = fill(self.tools_dir, directory, self._esbuild)
            except OSError as exc:
                log.warning("transpile_cache_failed", dir=str(directory), error=str(exc))
                continue
            self.directory = directory
            if report.written or report.removed:
                log.info("transpile_cache_filled", dir=str(directory), written=report.written,
                         present=report.present, skipped=report.skipped, removed=report.removed,
                         ms=round((time.monotonic() - started) * 1000, 1))
