"""An import: a stream trusted in nothing, checked entry by entry into staging folders, renamed into place at the end.

The staging folders lie beside the user's (same filesystem, a name no user can have) and
are made as provisioning makes a user's: under ``hard`` enforcement a subvolume already in
the user's limited qgroup, so the kernel counts every byte written. Nothing is read before
the manifest, whose sizes are held against the user's quota first; each entry must then be
in the manifest once, of its kind and size, and hash to its sha256. Files are created with
O_EXCL | O_NOFOLLOW below folder handles this import made. The email database is checked
(sha256, then ``PRAGMA integrity_check``) before anything is renamed. Any refusal removes
both staging folders: nothing of the user is left half-made.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import posixpath
import shutil
import sqlite3
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from sandboxd.config import AUTO_SANDBOX_ID, Config, email_db_path
from sandboxd.storage import btrfs
from sandboxd.storage.moved import remove_folder
from sandboxd.storage.provision import Area, areas, new_user_folder
from sandboxd.storage.transfer.manifest import (EMAIL_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES, ArchiveRefused, Entry,
                                                Manifest, parse_manifest)
from sandboxd.storage.transfer.tarstream import TarReader

STAGING_SUFFIX = "~sandboxd-import"  # "~" is in no user name: never measured or served as a user
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_RENAME_NOREPLACE = 1


class UserExists(ArchiveRefused):
    """The user already has data on this host."""


@dataclass
class _Staging:
    """One area's staging folder: filled, then renamed to ``final``."""

    root: Path
    name: str
    final: str
    fd: int
    subvolume: bool

    def remove(self) -> None:
        os.close(self.fd)
        root = os.open(self.root, _DIR)
        try:
            if self.subvolume and os.geteuid() == 0:
                btrfs.delete_subvolume(root, self.name)
            else:
                shutil.rmtree(self.name, dir_fd=root)
        except OSError:
            shutil.rmtree(self.root / self.name, ignore_errors=True)
        finally:
            os.close(root)


@dataclass
class Imported:
    user: str
    files: int
    bytes: int
    seconds: float
    quota: dict[str, int]  # the exporting host's limits, from the manifest
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        return {"user": self.user, "files": self.files, "bytes": self.bytes, "seconds": round(self.seconds, 3),
                "quota": self.quota, "warnings": self.warnings}


@dataclass(frozen=True)
class Ownership:
    """Who owns what an import writes: ``daemon`` the folders (as provisioning), ``sandbox`` what a tool wrote."""

    daemon: tuple[int, int]
    sandbox: tuple[int, int] | None  # None: not root, nothing can be given away (the folders' ACLs let the sandbox in)
    privileged: bool  # qgroups can be set (root)

    @classmethod
    def of(cls, config: Config) -> Ownership:
        root = os.geteuid() == 0
        setting = config.sandbox.user
        uid, _, gid = (f"{AUTO_SANDBOX_ID}" if setting == "auto" else setting).partition(":")
        return cls((os.getuid(), os.getgid()), (int(uid), int(gid or uid)) if root else None, root)


def import_user(config: Config, read: Callable[[int], bytes], ownership: Ownership,
                *, exists: Callable[[str], str | None] | None = None) -> Imported:
    """Import the archive ``read`` streams (blocking). ``exists(user)``: why the user is already here, or None.

    ArchiveRefused (naming the entry) when anything in it fails a check; UserExists when the user has data here."""
    started = time.monotonic()
    reader = TarReader(read)
    manifest = _read_manifest(reader)
    user = manifest.user
    held = (exists or (lambda _user: None))(user) or _already_here(config, user)
    if held is not None:
        raise UserExists(user, f"{held}; remove it first (or import on another host): an import never overwrites")
    _check_quota(config, manifest)
    stagings = _make_staging(config, user, ownership)
    try:
        files = _fill(reader, manifest, stagings, ownership)
        if manifest.email is not None:
            _check_database(stagings["email"], manifest.email)
        _rename_into_place(stagings)
    except BaseException:
        for staging in stagings.values():
            staging.remove()
        raise
    for staging in stagings.values():
        os.close(staging.fd)
    warnings = []
    limits = config.storage.limits(user)
    if limits != (manifest.quota_bytes, manifest.quota_inodes):
        warnings.append(f"this host's quota for {user} is {limits[0]} bytes and {limits[1]} files; the exporting "
                        f"host's was {manifest.quota_bytes} and {manifest.quota_inodes} (storage.users sets it)")
    return Imported(user, files, manifest.total_bytes, time.monotonic() - started,
                    {"bytes": manifest.quota_bytes, "inodes": manifest.quota_inodes}, warnings)


def _read_manifest(reader: TarReader) -> Manifest:
    first = reader.next()
    if first is None or first.name != MANIFEST_NAME or first.kind != "file":
        raise ArchiveRefused(first.name if first else "the archive",
                             f"an archive starts with {MANIFEST_NAME}; this is not a sandboxd export")
    if first.size > MAX_MANIFEST_BYTES:
        raise ArchiveRefused(MANIFEST_NAME, f"it is {first.size} bytes, more than {MAX_MANIFEST_BYTES}")
    return parse_manifest(b"".join(reader.data()))


def _already_here(config: Config, user: str) -> str | None:
    for folder in (config.data_path / user, email_db_path(config, user).parent):
        if os.path.lexists(folder):
            return f"{user} already has data on this host: {folder}"
    return None


def _check_quota(config: Config, manifest: Manifest) -> None:
    """The manifest's sizes held against this host's limits for the user, before any data is read."""
    limit_bytes, limit_inodes = config.storage.limits(manifest.user)
    total, files = 0, 1  # the user's folder itself is a file
    for entry in manifest.entries + ((manifest.email,) if manifest.email else ()):
        total, files = total + entry.size, files + 1
        if total > limit_bytes or files > limit_inodes:
            raise ArchiveRefused(entry.tar_name, f"with it the archive holds more than the user's quota here "
                                                 f"({limit_bytes} bytes, {limit_inodes} files; storage.quota_bytes, "
                                                 "storage.quota_inodes or storage.users raise it)")


def _make_staging(config: Config, user: str, ownership: Ownership) -> dict[str, _Staging]:
    groups: dict[str, int] = {}  # the user's qgroup on each filesystem, made with their first subvolume
    made: dict[str, _Staging] = {}
    try:
        for area in areas(config):
            final = area.folder(config, user)
            final.parent.mkdir(parents=True, exist_ok=True)
            here = Area(area.name, final.parent, area.per_user_root)
            name = final.name + STAGING_SUFFIX
            _clear(final.parent, name)  # an import cut short (a crash) left it
            fd, subvolume = new_user_folder(config, here, name, user, ownership.daemon, groups,
                                            privileged=ownership.privileged)
            made[area.name] = _Staging(final.parent, name, final.name, fd, subvolume)
    except BaseException:
        for staging in made.values():
            staging.remove()
        raise
    return made


def _clear(root: Path, name: str) -> None:
    if os.path.lexists(root / name):
        remove_folder(root, name)


class _Folders:
    """Handles on the staging folder's folders, opened below its top without following links; the last one kept."""

    def __init__(self, top: int) -> None:
        self.top = top
        self._path: str | None = None
        self._fd = -1

    def open(self, path: str) -> int:
        if path == "":
            return self.top
        if path != self._path:
            self.close()
            fd = os.dup(self.top)
            try:
                for part in path.split("/"):
                    child = os.open(part, _DIR, dir_fd=fd)
                    os.close(fd)
                    fd = child
            except BaseException:
                os.close(fd)
                raise
            self._path, self._fd = path, fd
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._path, self._fd = None, -1


def _fill(reader: TarReader, manifest: Manifest, stagings: dict[str, _Staging], ownership: Ownership) -> int:
    """Every entry after the manifest, checked against it and written; the files' count."""
    expected = manifest.by_tar_name()
    seen: set[str] = set()
    folders = _Folders(stagings["data"].fd)
    files = 0
    try:
        while (head := reader.next()) is not None:
            entry = expected.get(head.name)
            if entry is None:
                raise ArchiveRefused(head.name, "it is not in the manifest")
            if head.name in seen:
                raise ArchiveRefused(head.name, "it is in the archive twice")
            seen.add(head.name)
            if (head.kind, head.size, head.target or None) != (entry.kind, entry.size, entry.target):
                raise ArchiveRefused(head.name, f"the manifest says {entry.kind} of {entry.size} bytes"
                                                f"{' to ' + repr(entry.target) if entry.target else ''}, the archive "
                                                f"has {head.kind} of {head.size}")
            if entry is manifest.email:
                _write_file(reader, stagings["email"].fd, "emails.db", entry, ownership)
                continue
            parent = folders.open(posixpath.dirname(entry.path))
            files += _write(reader, parent, entry, ownership)
        missing = next((name for name in expected if name not in seen), None)
        if missing is not None:
            raise ArchiveRefused(missing, "it is in the manifest but not in the archive: the archive is truncated")
        _set_folder_modes(folders, manifest.entries)
    finally:
        folders.close()
    return files


def _write(reader: TarReader, parent: int, entry: Entry, ownership: Ownership) -> int:
    name = posixpath.basename(entry.path)
    try:
        if entry.kind == "dir":
            _folder(parent, name)
            _own(parent, name, entry, ownership)
            return 0
        if entry.kind == "symlink":
            assert entry.target is not None
            os.symlink(entry.target, name, dir_fd=parent)
            _own(parent, name, entry, ownership)
            return 0
    except FileExistsError:
        raise ArchiveRefused(entry.path, "it is in the archive twice") from None
    _write_file(reader, parent, name, entry, ownership)
    return 1


def _folder(parent: int, name: str) -> None:
    """A folder made (its mode set once it is filled: a read-only folder must still take its files), or the
    top's ``tools`` that provisioning made already (never a link: the archive's duplicates were refused before)."""
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        if not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            raise


def _write_file(reader: TarReader, parent: int, name: str, entry: Entry, ownership: Ownership) -> None:
    try:
        fd = os.open(name, _NEW_FILE, 0o600, dir_fd=parent)
    except FileExistsError:
        raise ArchiveRefused(entry.path, "it is in the archive twice") from None
    try:
        digest = hashlib.sha256()
        for chunk in reader.data():
            digest.update(chunk)
            _write_all(fd, chunk, entry)
        if digest.hexdigest() != entry.sha256:
            raise ArchiveRefused(entry.path, "its bytes do not hash to the manifest's sha256: the archive is damaged "
                                             "or was altered")
        os.fchmod(fd, entry.mode)
        if entry.owner == "sandbox" and ownership.sandbox is not None:
            os.fchown(fd, *ownership.sandbox)
        os.utime(fd, (entry.mtime, entry.mtime))
    finally:
        os.close(fd)


def _write_all(fd: int, chunk: bytes, entry: Entry) -> None:
    view = memoryview(chunk)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        if exc.errno in (errno.EDQUOT, errno.ENOSPC):
            raise ArchiveRefused(entry.path, f"the user's quota (or the disk) is full here ({exc.strerror})") from None
        raise


def _own(parent: int, name: str, entry: Entry, ownership: Ownership) -> None:
    if entry.owner == "sandbox" and ownership.sandbox is not None:
        os.chown(name, *ownership.sandbox, dir_fd=parent, follow_symlinks=False)


def _set_folder_modes(folders: _Folders, entries: tuple[Entry, ...]) -> None:
    """Each folder's own mode, deepest first, once everything is in it."""
    for entry in reversed(entries):
        if entry.kind == "dir":
            parent = folders.open(posixpath.dirname(entry.path))
            os.chmod(posixpath.basename(entry.path), entry.mode, dir_fd=parent, follow_symlinks=False)
            os.utime(posixpath.basename(entry.path), (entry.mtime, entry.mtime), dir_fd=parent, follow_symlinks=False)


def _check_database(staging: _Staging, entry: Entry) -> None:
    """The email database's sha256 was checked as it was written; SQLite now checks its structure."""
    path = f"/proc/self/fd/{staging.fd}/emails.db"
    try:
        db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
        try:
            rows = db.execute("PRAGMA integrity_check").fetchall()
        finally:
            db.close()
    except sqlite3.Error as exc:
        raise ArchiveRefused(entry.path, f"it is not a SQLite database ({exc})") from None
    if rows != [("ok",)]:
        raise ArchiveRefused(entry.path, f"SQLite's integrity check fails: {rows[0][0]}")


def _rename_into_place(stagings: dict[str, _Staging]) -> None:
    """Each staging folder renamed to the user's, never over one that appeared meanwhile; undone if one fails."""
    done: list[_Staging] = []
    try:
        for staging in stagings.values():
            _rename(staging.root, staging.name, staging.final)
            done.append(staging)
    except OSError as exc:
        for staging in done:
            _rename(staging.root, staging.final, staging.name)
        raise UserExists(str(stagings["data"].root / stagings["data"].final),
                         f"it appeared while the import ran ({exc.strerror}); nothing was imported") from None


def _rename(root: Path, old: str, new: str) -> None:
    root_fd = os.open(root, _DIR)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.renameat2(root_fd, old.encode(), root_fd, new.encode(), _RENAME_NOREPLACE) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    finally:
        os.close(root_fd)
