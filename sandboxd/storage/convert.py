"""A plain user folder found under hard enforcement, made a quota subvolume: copied, swapped, removed.

An operator's ``mkdir`` or ``cp -r`` (a tool installed by copying), a daemon that ran before
the quota, or ``sandboxd run --user`` on an older version leave ``DATA_PATH/<user>`` as a plain
folder, which no qgroup limits. The conversion makes a fresh subvolume under a name no user can
have, puts it under the user's qgroup while empty, and copies the folder into it. So the kernel
counts the copy against the quota: a folder that holds more fails with EDQUOT and stays as it
was, and the user is refused with the fix. Then one ``renameat2(RENAME_EXCHANGE)`` swaps the
two, and the old tree is removed. Nothing is served from the folder meanwhile: it runs before
the user's first sandbox.

The source is a tree a sandbox may have written, so it is read only through handles opened
below its top without following links. A link is copied as a link, never followed. The copy
is a subvolume no sandbox mounts, only this code writes it. Sparse files stay sparse, hard
links stay links, and owners, modes, times and extended attributes (ACLs) are kept. Sockets
and devices are left out (a sandbox can make neither a device nor a socket anyone serves).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from dataclasses import dataclass, field
from typing import Callable

from sandboxd.logging import get_logger
from sandboxd.storage import btrfs

log = get_logger("sandboxd.storage")

TEMP_SUFFIX = "~sandboxd-convert"  # "~" is in no user name (users.py): never measured or served as a user
MAX_DEPTH = 100  # folders deep: each level holds two handles while its folders are copied
_RENAME_EXCHANGE = 2
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO swapped in must not block
_CHUNK = 1 << 20


class ConversionFailed(OSError):
    """The plain folder could not become a subvolume; it is left as it was. The message names the fix."""


@dataclass
class _Copy:
    dst_root: int
    links: dict[tuple[int, int], str] = field(default_factory=dict)  # (dev, ino) → path below dst_root
    skipped: int = 0  # sockets and devices


def to_subvolume(root_fd: int, name: str, join: Callable[[int], object], finish: Callable[[int], None]) -> int:
    """Replace the plain folder ``name`` in ``root_fd`` by a subvolume with the same contents; its handle.

    ``join(fd)`` puts the new, empty subvolume under the user's limited qgroup before the copy;
    ``finish(fd)`` sets its top's mode and owner, as for a folder made new (its ACLs are copied first).
    Raises ConversionFailed (the folder untouched) when the copy cannot be made.
    """
    temp = name + TEMP_SUFFIX
    _remove(root_fd, temp)  # a conversion cut short (a crash) left it
    new_fd, _ = btrfs.open_subvolume(root_fd, temp, create=True)
    try:
        join(new_fd)
        old_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        try:
            copy = _Copy(new_fd)
            _copy_folder(old_fd, new_fd, "", copy, 0)
            _copy_xattrs(old_fd, new_fd)
            finish(new_fd)
        finally:
            os.close(old_fd)
        os.fsync(new_fd)
        os.sync()  # the copy is on disk before the old tree is removed
        _exchange(root_fd, temp, name)
    except OSError as exc:
        os.close(new_fd)
        _remove(root_fd, temp)
        raise _failed(name, exc) from None
    except BaseException:
        os.close(new_fd)
        _remove(root_fd, temp)
        raise
    if not _remove(root_fd, temp):
        log.warning("storage_convert_leftover", folder=name, leftover=temp,
                    detail="the old plain folder could not be removed; it is no user's now: remove it")
    log.info("storage_folder_converted", folder=name, skipped_sockets_and_devices=copy.skipped)
    return new_fd


def _failed(name: str, exc: OSError) -> ConversionFailed:
    if exc.errno in (errno.EDQUOT, errno.ENOSPC):
        why = ("it holds more than the user's quota (storage.quota_bytes). Delete files in it, or raise the quota "
               "(storage.users), and the next call converts it")
    elif exc.errno == errno.ELOOP and "deep" in str(exc):
        why = f"{exc.strerror}. Flatten it or remove the deepest folders, and the next call converts it"
    else:
        why = (f"{exc}. Fix that, or stop sandboxd and recreate it as a subvolume (docs/install.md, "
               "'Disk quotas')")
    return ConversionFailed(f"{name} is a plain folder, which no quota limits, and it could not be made a quota "
                            f"subvolume: {why}. It is served only under its quota")


def _copy_folder(src: int, dst: int, where: str, copy: _Copy, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise OSError(errno.ELOOP, f"the folder is more than {MAX_DEPTH} folders deep")
    with os.scandir(src) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        try:
            info = os.stat(name, dir_fd=src, follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed meanwhile
        _copy_entry(src, dst, name, info, f"{where}/{name}" if where else name, copy, depth)


def _copy_entry(src: int, dst: int, name: str, info: os.stat_result, where: str, copy: _Copy, depth: int) -> None:
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        _copy_subfolder(src, dst, name, where, copy, depth)
    elif stat.S_ISREG(mode):
        _copy_file(src, dst, name, where, copy)
    elif stat.S_ISLNK(mode):
        os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
        os.chown(name, info.st_uid, info.st_gid, dir_fd=dst, follow_symlinks=False)
        os.utime(name, ns=(info.st_atime_ns, info.st_mtime_ns), dir_fd=dst, follow_symlinks=False)
    elif stat.S_ISFIFO(mode):
        os.mkfifo(name, 0o600, dir_fd=dst)
        fd = os.open(name, _FILE_FLAGS, dir_fd=dst)
        try:
            _copy_metadata(None, fd, info)
        finally:
            os.close(fd)
    else:
        copy.skipped += 1


def _copy_subfolder(src: int, dst: int, name: str, where: str, copy: _Copy, depth: int) -> None:
    try:
        sub_src = os.open(name, _DIR_FLAGS, dir_fd=src)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):  # swapped for a link or a file meanwhile
            return
        raise
    try:
        os.mkdir(name, 0o700, dir_fd=dst)
    except BaseException:
        os.close(sub_src)
        raise
    try:
        sub_dst = os.open(name, _DIR_FLAGS, dir_fd=dst)
        try:
            _copy_folder(sub_src, sub_dst, where, copy, depth + 1)
            _copy_metadata(sub_src, sub_dst, os.fstat(sub_src))  # after the contents: their writes touch its times
        finally:
            os.close(sub_dst)
    finally:
        os.close(sub_src)


def _copy_file(src: int, dst: int, name: str, where: str, copy: _Copy) -> None:
    try:
        in_fd = os.open(name, _FILE_FLAGS, dir_fd=src)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # swapped for a link or a socket meanwhile: not a file now
            return
        raise
    try:
        info = os.fstat(in_fd)
        if not stat.S_ISREG(info.st_mode):
            return
        key = (info.st_dev, info.st_ino)
        if info.st_nlink > 1 and key in copy.links and _link(copy, copy.links[key], where):
            return
        out_fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst)
        try:
            _copy_data(in_fd, out_fd, info.st_size)
            _copy_metadata(in_fd, out_fd, info)
        finally:
            os.close(out_fd)
        if info.st_nlink > 1:
            copy.links[key] = where
    finally:
        os.close(in_fd)


def _link(copy: _Copy, first: str, where: str) -> bool:
    """Another name for a file already copied; False when the path is too long to link by (then it is copied)."""
    try:
        os.link(first, where, src_dir_fd=copy.dst_root, dst_dir_fd=copy.dst_root, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.ENAMETOOLONG, errno.EMLINK):
            return False
        raise
    return True


def _copy_data(in_fd: int, out_fd: int, size: int) -> None:
    """The file's data regions only: a sparse file stays sparse, and counts only what it holds."""
    offset = 0
    while offset < size:
        try:
            start = os.lseek(in_fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no data past offset: the rest is a hole
                break
            raise
        end = os.lseek(in_fd, start, os.SEEK_HOLE)
        while start < end:
            chunk = os.pread(in_fd, min(_CHUNK, end - start), start)
            if not chunk:
                break
            os.pwrite(out_fd, chunk, start)
            start += len(chunk)
        offset = end
    os.ftruncate(out_fd, size)


def _copy_metadata(src: int | None, dst: int, info: os.stat_result) -> None:
    """Extended attributes (ACLs), mode, times, then owner: the handle's owner may set the others."""
    if src is not None:
        _copy_xattrs(src, dst)
    os.fchmod(dst, stat.S_IMODE(info.st_mode))
    os.utime(dst, ns=(info.st_atime_ns, info.st_mtime_ns))
    os.fchown(dst, info.st_uid, info.st_gid)


def _copy_xattrs(src: int, dst: int) -> None:
    for key in os.listxattr(src):
        try:
            os.setxattr(dst, key, os.getxattr(src, key))
        except OSError as exc:
            if exc.errno in (errno.EDQUOT, errno.ENOSPC):
                raise
            log.warning("storage_convert_xattr_skipped", name=key, error=str(exc))


def _exchange(root_fd: int, a: str, b: str) -> None:
    """Swap two names in one folder atomically (renameat2 RENAME_EXCHANGE)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(root_fd, a.encode(), root_fd, b.encode(), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"renameat2 RENAME_EXCHANGE {a} and {b}: {os.strerror(code)}")


def _remove(root_fd: int, name: str) -> bool:
    """Remove the tree ``name`` without following links (an empty subvolume goes with rmdir); whether it is gone."""
    try:
        os.lstat(name, dir_fd=root_fd)
    except FileNotFoundError:
        return True
    try:
        shutil.rmtree(name, dir_fd=root_fd)
    except PermissionError:
        # A sticky folder a sandbox made: its uid's files in it go only with CAP_FOWNER, which the helper
        # lacks. Its CAP_CHOWN makes the tree its own first (never through a link), then they go.
        try:
            _own(root_fd, name)
            shutil.rmtree(name, dir_fd=root_fd)
        except OSError as exc:
            log.warning("storage_convert_remove_failed", folder=name, error=str(exc))
            return False
    except OSError as exc:
        log.warning("storage_convert_remove_failed", folder=name, error=str(exc))
        return False
    return True


def _own(root_fd: int, name: str) -> None:
    uid, gid = os.geteuid(), os.getegid()
    os.chown(name, uid, gid, dir_fd=root_fd, follow_symlinks=False)
    for _folder, folders, files, folder_fd in os.fwalk(name, dir_fd=root_fd, follow_symlinks=False):
        for entry in folders + files:
            os.chown(entry, uid, gid, dir_fd=folder_fd, follow_symlinks=False)
