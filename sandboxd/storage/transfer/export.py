"""An export: a consistent snapshot of one user (``take_snapshot``), then its stream (``stream``), apart.

Kept apart so a move can hold the user, take the snapshot, stream it to a peer later, and
ask before it flips whether the email database changed since (``Snapshot.email_changed``).

What makes it consistent: on btrfs, as root, a read-only snapshot of the user's subvolume,
which takes milliseconds whatever it holds, so calls need not wait; elsewhere the folder is
read live, and the caller (the daemon) holds the user's calls until the stream ends. The
email database is copied with SQLite's backup API either way: a writer outside sandboxd
(the mail sync) may commit meanwhile, and its WAL contents are in the copy.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import zstandard

from sandboxd.config import Config, email_db_path
from sandboxd.logging import get_logger
from sandboxd.storage import btrfs
from sandboxd.storage.transfer.manifest import (EMAIL_NAME, MANIFEST_NAME, ArchiveRefused, Entry, Manifest,
                                                check_link)
from sandboxd.storage.transfer.tarstream import END, RECORD, header, padding

log = get_logger("sandboxd.storage")

CHUNK = 1 << 20
MAX_DEPTH = 100
WORK_SUFFIX = "~sandboxd-export"  # "~" is in no user name: never taken for a user's folder
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class ExportFailed(OSError):
    """The user could not be exported; the message says why and what to do."""


@dataclass
class Snapshot:
    """What an export streams: the manifest, the folder it was made from (``source``, a handle), the email copy."""

    manifest: Manifest
    source: int
    frozen: bool  # a read-only btrfs snapshot (else the live folder: the user's calls must stay held)
    work: Path  # a folder of the export's own in DATA_PATH: the snapshot and the email copy
    email_copy: Path | None
    skipped: list[str] = field(default_factory=list)  # fifos, sockets, devices, links out of the folder
    _email_watch: sqlite3.Connection | None = None
    _email_version: int = 0

    def email_changed(self) -> bool:
        """Whether another connection committed to the user's email database since the copy was taken."""
        if self._email_watch is None:
            return False
        return int(self._email_watch.execute("PRAGMA data_version").fetchone()[0]) != self._email_version

    def close(self) -> None:
        os.close(self.source)
        if self._email_watch is not None:
            self._email_watch.close()
        work_fd = os.open(self.work, _DIR)
        try:
            if self.frozen:
                btrfs.delete_subvolume(work_fd, "data")
        finally:
            os.close(work_fd)
        _remove_tree(self.work)


def take_snapshot(config: Config, user: str, *, sandbox_uid: int, freeze: bool) -> Snapshot:
    """Snapshot ``user`` (blocking: walks and hashes every file). ``freeze``: try a read-only btrfs snapshot.

    ExportFailed when the user has no folder here."""
    folder = config.data_path / user
    work = Path(tempfile.mkdtemp(prefix=user + WORK_SUFFIX, dir=config.data_path))
    try:
        source, frozen = _open_source(config.data_path, user, work, freeze=freeze)
    except FileNotFoundError:
        _remove_tree(work)
        raise ExportFailed(f"{user} has no folder here ({folder}); export them on the host that holds them") from None
    snap = Snapshot(Manifest(user, 0, 0, (), None), source, frozen, work, None)
    try:
        entries: list[Entry] = []
        _walk(source, "", 0, sandbox_uid, entries, snap.skipped)
        email = _copy_email(config, user, work / "emails.db", snap)
    except BaseException:
        snap.close()
        raise
    limit_bytes, limit_inodes = config.storage.limits(user)
    snap.manifest = Manifest(user, limit_bytes, limit_inodes, tuple(entries), email)
    return snap


def _open_source(data_path: Path, user: str, work: Path, *, freeze: bool) -> tuple[int, bool]:
    """A handle on what the export reads, and whether it is a frozen snapshot."""
    root = os.open(data_path, _DIR)
    try:
        live = os.open(user, _DIR, dir_fd=root)
        if not freeze or os.fstat(live).st_ino != btrfs.SUBVOLUME_ROOT_INO or btrfs.filesystem_id(live) is None:
            return live, False
        work_fd = os.open(work, _DIR)
        try:
            btrfs.snapshot(work_fd, live, "data")
            return os.open("data", _DIR, dir_fd=work_fd), True
        except OSError as exc:
            log.warning("export_snapshot_failed", user=user, error=str(exc), detail="reading the live folder")
            return os.dup(live), False
        finally:
            os.close(work_fd)
            os.close(live)
    finally:
        os.close(root)


def _walk(folder: int, prefix: str, depth: int, sandbox_uid: int, entries: list[Entry], skipped: list[str]) -> None:
    if depth > MAX_DEPTH:
        raise ExportFailed(f"{prefix} is more than {MAX_DEPTH} folders deep; flatten it and export again")
    for name in sorted(os.listdir(folder)):
        path = prefix + name
        try:
            path.encode("utf-8")
            info = os.stat(name, dir_fd=folder, follow_symlinks=False)
        except UnicodeEncodeError:
            skipped.append(path.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
            continue
        except FileNotFoundError:
            continue
        entry = _entry(folder, name, path, info, sandbox_uid)
        if entry is None:
            skipped.append(path)
            continue
        entries.append(entry)
        if entry.kind == "dir":
            child = os.open(name, _DIR, dir_fd=folder)
            try:
                _walk(child, path + "/", depth + 1, sandbox_uid, entries, skipped)
            finally:
                os.close(child)


def _entry(folder: int, name: str, path: str, info: os.stat_result, sandbox_uid: int) -> Entry | None:
    """The manifest's entry for one thing in the folder; None for what an archive does not carry."""
    common = {"mode": stat.S_IMODE(info.st_mode) & 0o777, "mtime": int(info.st_mtime),
              "owner": "sandbox" if info.st_uid == sandbox_uid else "host"}
    if stat.S_ISDIR(info.st_mode):
        return Entry(path, "dir", **common)  # type: ignore[arg-type]
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(name, dir_fd=folder)
        try:
            check_link(path, target)
        except ArchiveRefused:
            return None  # an import would refuse it: a link out of the folder is left behind, and said
        return Entry(path, "symlink", target=target, **common)  # type: ignore[arg-type]
    if not stat.S_ISREG(info.st_mode):
        return None
    fd = os.open(name, _FILE, dir_fd=folder)
    try:
        size, digest = _hash(fd)
    finally:
        os.close(fd)
    return Entry(path, "file", size=size, sha256=digest, **common)  # type: ignore[arg-type]


def _hash(fd: int) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    while chunk := os.read(fd, CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def _copy_email(config: Config, user: str, copy: Path, snap: Snapshot) -> Entry | None:
    """The user's email database copied with SQLite's backup API (WAL contents included); its entry, or None."""
    db = email_db_path(config, user)
    try:
        before = os.lstat(db)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(before.st_mode):
        raise ExportFailed(f"{db} is not a regular file (a link?); put the user's email database back and export again")
    # Asked again (email_changed) and closed from other worker threads than the one that copies.
    source = sqlite3.connect(f"file:{db}?mode=ro", uri=True, check_same_thread=False)
    try:
        version = int(source.execute("PRAGMA data_version").fetchone()[0])
        with sqlite3.connect(copy) as target:
            source.backup(target)
        target.close()
        after = os.stat(db)
    except BaseException:
        source.close()
        raise
    if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
        source.close()
        raise ExportFailed(f"{db} was replaced while it was copied; export again")
    snap.email_copy, snap._email_watch, snap._email_version = copy, source, version
    fd = os.open(copy, _FILE)
    try:
        size, digest = _hash(fd)
    finally:
        os.close(fd)
    return Entry(EMAIL_NAME, "file", mode=0o600, size=size, sha256=digest, mtime=int(after.st_mtime))


def stream(snap: Snapshot) -> Iterator[bytes]:
    """The archive of ``snap``, a tar in chunks: manifest.json first, then the folder's entries, then the database.

    A file that no longer matches its manifest entry (changed on a live folder) raises ExportFailed;
    the stream then lacks its end, and an import of it refuses it as truncated."""
    written = 0
    for chunk in _entries(snap):
        written += len(chunk)
        yield chunk
    yield END + b"\0" * (-(written + len(END)) % RECORD)


def _entries(snap: Snapshot) -> Iterator[bytes]:
    manifest = snap.manifest.to_json()
    yield header(MANIFEST_NAME, "file", mode=0o600, size=len(manifest)) + manifest + padding(len(manifest))
    for entry in snap.manifest.entries:
        yield from _entry_bytes(entry, lambda path: _open_under(snap.source, path))
    email, copy = snap.manifest.email, snap.email_copy
    if email is not None and copy is not None:
        yield from _entry_bytes(email, lambda _path: os.open(copy, _FILE))


def _entry_bytes(entry: Entry, opener: Callable[[str], int]) -> Iterator[bytes]:
    yield header(entry.tar_name, entry.kind, mode=entry.mode, size=entry.size, target=entry.target or "",
                 mtime=entry.mtime)
    if entry.kind != "file":
        return
    fd = opener(entry.path)
    try:
        digest, size = hashlib.sha256(), 0
        while size < entry.size and (chunk := os.read(fd, min(CHUNK, entry.size - size))):
            digest.update(chunk)
            size += len(chunk)
            yield chunk
        if size != entry.size or digest.hexdigest() != entry.sha256 or os.read(fd, 1):
            raise ExportFailed(f"{entry.path} changed while it was exported; export again (with the user's calls held)")
    finally:
        os.close(fd)
    yield padding(size)


def _open_under(root: int, path: str) -> int:
    """A file below ``root``, opened without following a link anywhere on the way."""
    *folders, name = path.split("/")
    fd = os.dup(root)
    try:
        for part in folders:
            child = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = child
        return os.open(name, _FILE, dir_fd=fd)
    finally:
        os.close(fd)


def compressed(chunks: Iterator[bytes], level: int = 3) -> Iterator[bytes]:
    """``chunks`` as one zstd frame, streamed."""
    compressor = zstandard.ZstdCompressor(level=level).compressobj()
    for chunk in chunks:
        out = compressor.compress(chunk)
        if out:
            yield out
    yield compressor.flush()


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)
