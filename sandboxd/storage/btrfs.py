"""btrfs subvolumes and qgroups through their ioctls: the hard byte quota on this kernel.

Each user folder (DATA_PATH/<user>, the email folder) is a subvolume; a level-1 qgroup
``1/<id of the user's data subvolume>`` holds the user's subvolumes on one filesystem and
carries the limit, so data and mail share one quota. The kernel then fails a write past it
with EDQUOT. Every call works on a handle opened below a trusted folder without following
links, never on a path a sandbox could have changed. Creating a subvolume needs only write
access to its parent; qgroup changes need CAP_SYS_ADMIN (root, or the helper: helper.py).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import struct
import uuid
from pathlib import Path

# linux/btrfs.h: _IO*(0x94, nr, size) request numbers.
_IOC_SUBVOL_CREATE = 0x5000940E  # _IOW(14, struct btrfs_ioctl_vol_args: 4096)
_IOC_INO_LOOKUP = 0xD0009412  # _IOWR(18, struct btrfs_ioctl_ino_lookup_args: 4096)
_IOC_FS_INFO = 0x8400941F  # _IOR(31, struct btrfs_ioctl_fs_info_args: 1024)
_IOC_QGROUP_ASSIGN = 0x40189429  # _IOW(41, {assign, src, dst}: 24)
_IOC_QGROUP_CREATE = 0x4010942A  # _IOW(42, {create, qgroupid}: 16)
_IOC_QGROUP_LIMIT = 0x8030942B  # _IOR(43, {qgroupid, {flags, max_rfer, max_excl, rsv_rfer, rsv_excl}}: 48)
_IOC_SNAP_DESTROY = 0x5000940F  # _IOW(15, struct btrfs_ioctl_vol_args: 4096)
_IOC_SNAP_CREATE_V2 = 0x50009417  # _IOW(23, struct btrfs_ioctl_vol_args_v2: 4096)
_SUBVOL_RDONLY = 1 << 1
_LIMIT_MAX_RFER = 1
SUBVOLUME_ROOT_INO = 256  # BTRFS_FIRST_FREE_OBJECTID: the inode of every subvolume's top folder
_NAME_MAX = 4087


class NotASubvolume(Exception):
    """A user folder exists as a plain folder (made before the quota): the kernel cannot limit it."""


def filesystem_id(fd: int) -> str | None:
    """The btrfs filesystem's UUID for an open handle on it; None on another filesystem."""
    buffer = bytearray(1024)
    try:
        fcntl.ioctl(fd, _IOC_FS_INFO, buffer)
    except OSError as exc:
        if exc.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    return str(uuid.UUID(bytes=bytes(buffer[16:32])))


def quota_enabled(fs_id: str) -> bool:
    """Whether `btrfs quota enable` was run on the filesystem (the kernel lists its qgroups in sysfs then)."""
    return Path(f"/sys/fs/btrfs/{fs_id}/qgroups").is_dir()


def subvolume_id(fd: int) -> int:
    """The id of the subvolume an open handle lies in (no privilege needed for this lookup)."""
    args = bytearray(struct.pack("<QQ", 0, SUBVOLUME_ROOT_INO).ljust(4096, b"\0"))
    fcntl.ioctl(fd, _IOC_INO_LOOKUP, args)
    return int(struct.unpack_from("<Q", args)[0])


def open_subvolume(parent_fd: int, name: str, *, create: bool) -> tuple[int, bool]:
    """A handle on the subvolume ``name`` in the folder ``parent_fd``, made when missing and ``create``;
    and whether it was made now.

    FileNotFoundError when missing and not ``create``; NotASubvolume when it is a plain folder;
    OSError(ELOOP/ENOTDIR) when it is a link or a file.
    """
    if "/" in name or name in ("", ".", "..") or len(name.encode()) > _NAME_MAX:
        raise ValueError(f"{name!r} is not a folder name")
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    created = False
    try:
        fd = os.open(name, flags, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            # A mutable buffer: fcntl copies at most 1024 bytes of an immutable one.
            fcntl.ioctl(parent_fd, _IOC_SUBVOL_CREATE, bytearray(struct.pack("<q4088s", 0, name.encode())))
            created = True
        except FileExistsError:
            pass  # made meanwhile: checked below like any other
        fd = os.open(name, flags, dir_fd=parent_fd)
    info = os.fstat(fd)
    if not stat.S_ISDIR(info.st_mode) or info.st_ino != SUBVOLUME_ROOT_INO:
        os.close(fd)
        raise NotASubvolume(name)
    return fd, created


def qgroup_id(level: int, ident: int) -> int:
    return (level << 48) | ident


def create_qgroup(fd: int, qgroup: int) -> None:
    try:
        fcntl.ioctl(fd, _IOC_QGROUP_CREATE, struct.pack("<QQ", 1, qgroup))
    except FileExistsError:
        pass


def assign_qgroup(fd: int, child: int, parent: int) -> None:
    """Make ``child`` count in ``parent``. On an empty or unshared subvolume the kernel updates the
    parent's figures at once; otherwise it marks the accounting inconsistent until a rescan."""
    try:
        fcntl.ioctl(fd, _IOC_QGROUP_ASSIGN, struct.pack("<QQQ", 1, child, parent))
    except FileExistsError:
        pass


def limit_qgroup(fd: int, qgroup: int, max_bytes: int) -> None:
    """Limit the bytes ``qgroup`` refers to (referenced, not exclusive: what the user's folders hold)."""
    fcntl.ioctl(fd, _IOC_QGROUP_LIMIT, struct.pack("<QQQQQQ", qgroup, _LIMIT_MAX_RFER, max_bytes, 0, 0, 0))


def qgroup_usage(fs_id: str, qgroup: int) -> tuple[int, int] | None:
    """(bytes referenced, limit or 0) of a qgroup, as the kernel counts them; None when unknown."""
    level, ident = qgroup >> 48, qgroup & ((1 << 48) - 1)
    base = Path(f"/sys/fs/btrfs/{fs_id}/qgroups/{level}_{ident}")
    try:
        return int((base / "referenced").read_text()), int((base / "max_referenced").read_text())
    except (OSError, ValueError):
        return None


def snapshot(parent_fd: int, source_fd: int, name: str) -> None:
    """A read-only snapshot of the subvolume ``source_fd``, as ``name`` in the folder ``parent_fd`` (same filesystem).

    Its blocks are shared, not copied: it takes milliseconds whatever the subvolume holds, and
    its own qgroup (0/<id>) is in no user's limited group, so it costs the user nothing."""
    if "/" in name or name in ("", ".", "..") or len(name.encode()) > 4039:
        raise ValueError(f"{name!r} is not a folder name")
    # {fd, transid, flags, 4 unused u64, name[4040]}
    args = bytearray(struct.pack("<qQQ32x", source_fd, 0, _SUBVOL_RDONLY) + name.encode().ljust(4040, b"\0"))
    fcntl.ioctl(parent_fd, _IOC_SNAP_CREATE_V2, args)


def delete_subvolume(parent_fd: int, name: str) -> None:
    """Remove the subvolume ``name`` in ``parent_fd`` with what it holds (read-only or not); needs CAP_SYS_ADMIN."""
    fcntl.ioctl(parent_fd, _IOC_SNAP_DESTROY, bytearray(struct.pack("<q4088s", 0, name.encode())))


_IOC_SUBVOL_SETFLAGS = 0x4008941A  # _IOW(26, __u64)


def set_read_only(fd: int) -> None:
    """Make the subvolume ``fd`` read-only (no write reaches it, by anyone); needs CAP_SYS_ADMIN."""
    fcntl.ioctl(fd, _IOC_SUBVOL_SETFLAGS, struct.pack("<Q", _SUBVOL_RDONLY))
