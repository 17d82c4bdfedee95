"""Bind-mount sources that no sandbox can redirect, and the sandbox uid's access to them.

Docker resolves a bind source by its path, following symbolic links, when the container
is created and again when it starts. Whatever a sandbox can write, it can turn into a
link: a user's tool that replaces ``/officer/user/emails.db`` by a link to another
user's database would get that database mounted into its next sandbox. So:

- no source lies in a tree a sandbox can write, except the user's ``tools`` folder,
  which is itself a mount point in every sandbox of that user (rename and unlink of a
  mount point fail with EBUSY there), so no running sandbox can swap it;
- each source is opened component by component below a trusted root (the data path,
  or the folder the operator put a file in) with ``O_NOFOLLOW``, so a link anywhere on
  the way is refused, and the type is checked on the opened handle;
- the sandbox's uid gets access through POSIX ACLs set on those handles, so the daemon
  never runs ``chown`` or ``chmod`` on a path a sandbox could have redirected.

A handle cannot be given to Docker itself: runc mounts inside the container's new mount
namespace, where a ``/proc/PID/fd/N`` of ours names a mount it cannot see (EINVAL).
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from sandboxd.container import CONTAINER_CACHE, CONTAINER_EMAIL_DIR, CONTAINER_TOOLS, CONTAINER_USER, CONTAINER_USER_TOOLS
from sandboxd.errors import BackendUnavailable, UnsafeMount
from sandboxd.sandbox.backend import SandboxSpec

Kind = Literal["dir", "file"]

# POSIX ACL xattr format (linux/posix_acl_xattr.h): a version, then (tag, perm, id) entries
# sorted by tag, then by id.
_ACL_VERSION = 2
_USER_OBJ, _USER, _GROUP_OBJ, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x10, 0x20
_UNDEFINED_ID = 0xFFFFFFFF
ACCESS_ACL, DEFAULT_ACL = "system.posix_acl_access", "system.posix_acl_default"
R, W, X = 4, 2, 1


def _split(root: Path, path: Path) -> tuple[Path, list[str]]:
    """The trusted root to walk from, and the components below it.

    ``root`` (the data path) when ``path`` lies inside it, else the path's own folder:
    a file the operator put elsewhere is trusted up to its folder, never the last step.
    """
    try:
        parts = path.relative_to(root).parts
        base = root
    except ValueError:
        base, parts = path.parent, (path.name,)
    if not parts or any(part in ("", ".", "..") for part in parts):
        raise UnsafeMount(f"{path} is not a path below {base}; sandboxd mounts only paths below their root.")
    return base, list(parts)


def open_beneath(root: Path, path: Path, kind: Kind, *, flags: int = os.O_PATH,
                 create_mode: int | None = None) -> tuple[int, str]:
    """Open ``path`` without following a link on the way from ``root``; (fd, the path as checked).

    Raises UnsafeMount when a component is a link or not a folder, or the last one is
    not of ``kind``; FileNotFoundError when something is missing, unless ``create_mode``
    (folders only) says to make the missing folders, with that mode.
    """
    base, parts = _split(root, path)
    real_base = os.path.realpath(base)  # the operator's own links above the root are theirs to make
    if create_mode is not None:
        os.makedirs(real_base, exist_ok=True)
    fd = os.open(real_base, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            step = (flags if last else os.O_PATH) | os.O_NOFOLLOW | os.O_CLOEXEC
            if last and kind == "file":
                step |= os.O_NONBLOCK  # a FIFO must not block the open (it is refused below)
            try:
                try:
                    next_fd = os.open(part, step, dir_fd=fd)
                except FileNotFoundError:
                    if create_mode is None or (last and kind != "dir"):
                        raise
                    try:
                        os.mkdir(part, create_mode, dir_fd=fd)
                    except FileExistsError:
                        pass  # made meanwhile by another start: opened (and checked) below
                    next_fd = os.open(part, step, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (20, 40):  # ENOTDIR, ELOOP: a link (O_NOFOLLOW) or a file on the way
                    raise _unsafe(path, f"{part} is a symbolic link or not a folder") from None
                raise
            os.close(fd)
            fd = next_fd
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode):
                raise _unsafe(path, f"{part} is a symbolic link")
            wanted_dir = not last or kind == "dir"
            if wanted_dir and not stat.S_ISDIR(mode):
                raise _unsafe(path, f"{part} is not a folder")
            if not wanted_dir and not stat.S_ISREG(mode):
                raise _unsafe(path, f"{part} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, os.path.join(real_base, *parts)


def _unsafe(path: Path, why: str) -> UnsafeMount:
    return UnsafeMount(
        f"sandboxd refuses to mount {path}: {why}. A sandbox could point such a path at another user's files; "
        "replace it with a real folder or file (the sandbox was not started).",
        data={"path": str(path)},
    )


def grant_access(fd: int, uid: int, perms: int, *, inherit: bool) -> None:
    """Give ``uid`` ``perms`` on the open file ``fd`` through its ACL (and, with ``inherit``, on what is created in it).

    The entries already there stay (an operator's grant to the mail sync's user, say), and
    the owner, group and other entries keep what they say, so nobody else gains anything
    but what a wider mask lets named entries do. Only the owner (or root) may set an ACL,
    which is why this runs on the daemon's own folders. The default ACL also keeps the
    folder's owner able to manage what the sandbox creates in it.
    """
    info = os.fstat(fd)
    mode = info.st_mode
    owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
    if info.st_uid == uid and owner & perms == perms:
        return
    current = _get_acl(fd, ACCESS_ACL)
    if current is not None:  # with an ACL, the mode's group bits are its mask: the group's own entry is inside
        group = next((p for tag, p, _ in _entries(current) if tag == _GROUP_OBJ), group)
    wanted = [(ACCESS_ACL, _acl_with(current, (owner, group, other), {uid: perms}))]
    if inherit:
        wanted.append((DEFAULT_ACL, _acl_with(_get_acl(fd, DEFAULT_ACL), (7, group, other),
                                              {uid: perms, info.st_uid: 7})))
    for name, acl in wanted:
        if _get_acl(fd, name) == acl:
            continue
        try:
            os.setxattr(fd, name, acl)
        except OSError as exc:
            if other & perms == perms and name == ACCESS_ACL:
                continue  # everyone may already do what the sandbox needs
            raise BackendUnavailable(
                f"the sandbox uid {uid} needs {_perm_text(perms)} access to {os.readlink(f'/proc/self/fd/{fd}')}, "
                f"and sandboxd could not grant it with an ACL ({exc.strerror}). Use a filesystem with POSIX ACLs "
                "for the data path, or give that uid access yourself (docs/install.md, 'The sandbox uid')."
            ) from None


def _perm_text(perms: int) -> str:
    return "".join(flag if perms & bit else "-" for flag, bit in (("r", R), ("w", W), ("x", X)))


def _entries(data: bytes | None) -> list[tuple[int, int, int]]:
    """(tag, perms, id) of an ACL xattr; empty for none."""
    if not data or len(data) < 4 or struct.unpack_from("<I", data)[0] != _ACL_VERSION:
        return []
    return [struct.unpack_from("<HHI", data, offset) for offset in range(4, len(data) - 7, 8)]


def _acl_with(current: bytes | None, base: tuple[int, int, int], users: dict[int, int]) -> bytes:
    """``current`` (or, without one, owner/group/other = ``base``) with each of ``users`` given at least its perms,
    and a mask that lets them have them."""
    found = {(tag, ident): perms for tag, perms, ident in _entries(current)}
    if found:
        mask = found.pop((_MASK, _UNDEFINED_ID), None)
    else:
        owner, group, other = base
        found = {(_USER_OBJ, _UNDEFINED_ID): owner, (_GROUP_OBJ, _UNDEFINED_ID): group,
                 (_OTHER, _UNDEFINED_ID): other}
        mask = None
    for uid, perms in users.items():
        found[(_USER, uid)] = found.get((_USER, uid), 0) | perms
    if mask is None:  # a minimal ACL: the group class was the group's entry alone
        mask = found[(_GROUP_OBJ, _UNDEFINED_ID)]
    for uid in users:
        mask |= found[(_USER, uid)]
    found[(_MASK, _UNDEFINED_ID)] = mask
    entries = sorted((tag, ident, perms) for (tag, ident), perms in found.items())
    return struct.pack("<I", _ACL_VERSION) + b"".join(struct.pack("<HHI", tag, perms, ident)
                                                      for tag, ident, perms in entries)


def _get_acl(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError:
        return None


def acl_users(path: Path, name: str = ACCESS_ACL) -> dict[int, int]:
    """uid → perms of the named-user entries of a file's ACL (for tests and diagnostics)."""
    try:
        data = os.getxattr(path, name, follow_symlinks=False)
    except OSError:
        return {}
    out = {}
    for offset in range(4, len(data), 8):
        tag, perms, ident = struct.unpack_from("<HHI", data, offset)
        if tag == _USER:
            out[ident] = perms
    return out


@dataclass(frozen=True)
class Bind:
    target: str  # the path inside the sandbox
    source: str  # the checked host path
    read_only: bool


def sandbox_binds(spec: SandboxSpec, uid: int) -> tuple[list[Bind], list[str]]:
    """The checked bind mounts of one sandbox, with ``uid`` given access to each; and warnings.

    The folders are made when missing (the user's data folder 0700: only the daemon and,
    through the ACL, the sandbox uid get in). The email database's folder is mounted
    whole (email_dir), read-only or read-write as ``spec.email_access`` says, or not at all;
    access it cannot be given is a warning, not a failed start.
    """
    root = spec.root
    if spec.provision is not None:  # before anything below makes the user's folders as plain ones
        spec.provision(spec.user)
    binds = [
        Bind(CONTAINER_TOOLS, _dir(root, spec.tools_dir, uid, R | X, 0o755), True),
        Bind(CONTAINER_USER, _dir(root, spec.user_dir, uid, R | W | X, 0o700), False),
        Bind(CONTAINER_USER_TOOLS, _dir(root, spec.user_tools_dir, uid, R | X, 0o755), True),
    ]
    if spec.transpile_cache is not None:  # the daemon's own folder; read-only, or one sandbox could poison all
        binds.append(Bind(CONTAINER_CACHE, _dir(root, spec.transpile_cache, uid, R | X, 0o755), True))
    warnings: list[str] = []
    # Fixed for the sandbox's life: a grant given for one call could not be taken back (sandbox/email_access.py).
    if spec.email_db is not None and spec.email_access != "none":
        email = email_dir(spec.email_db, root, uid, warnings)
        if email is not None:
            binds.append(Bind(CONTAINER_EMAIL_DIR, email, spec.email_access == "read"))
    return binds, warnings


def email_dir(db: Path, root: Path | None, uid: int, warnings: list[str]) -> str | None:
    """The checked folder of the email database ``db``, for /officer/data; None when there is none.

    Mounting the folder, not the file, makes the database's -journal, -wal and -shm the
    host's own files: SQLite in the sandbox and the host's mail sync share one WAL index,
    and a write killed half-way leaves its journal where the next opener rolls it back.
    A database made while the sandbox runs is there at its next call. Below the data path
    the folder is made when missing (0700); elsewhere it is the operator's to make.

    The sandbox uid gets rwx on the folder, by default on what is made in it, and rw on the
    database files already there. Those are opened below the checked folder without
    following links: a tool can make files in the folder, links included, and the daemon
    never follows one (nor may the mail sync, docs/install.md).
    """
    directory = db.parent
    inside = root is not None and directory.is_relative_to(root)
    base = root if root is not None and inside else directory.parent
    try:
        fd, checked = open_beneath(base, directory, "dir",
                                   flags=os.O_RDONLY | os.O_DIRECTORY, create_mode=0o700 if inside else None)
    except FileNotFoundError:
        return None  # no folder (yet): nothing at /officer/data
    try:
        try:
            grant_access(fd, uid, R | W | X, inherit=True)
        except BackendUnavailable as exc:
            warnings.append(exc.message)
        for suffix in _SQLITE_SIDECARS:
            problem = _grant_file(fd, db.name + suffix, uid)
            if problem is not None:
                warnings.append(f"{checked}/{db.name}{suffix}: {problem}")
    finally:
        os.close(fd)
    return checked


def _grant_file(dir_fd: int, name: str, uid: int) -> str | None:
    """Give ``uid`` rw on the regular file ``name`` in ``dir_fd``, never through a link; what went wrong, or None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: a link
            return ("a symbolic link, not followed and given no access (a tool may have made it; the mail sync "
                    "must not follow it either, docs/install.md)")
        return f"cannot be opened ({exc.strerror})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file; given no access"
        grant_access(fd, uid, R | W, inherit=False)
    except BackendUnavailable as exc:
        return exc.message
    finally:
        os.close(fd)
    return None


def _dir(root: Path | None, path: Path, uid: int, perms: int, mode: int) -> str:
    fd, checked = open_beneath(root or path.parent, path, "dir", flags=os.O_RDONLY | os.O_DIRECTORY,
                               create_mode=mode)
    try:
        grant_access(fd, uid, perms, inherit=True)
    finally:
        os.close(fd)
    return checked


# SQLite's companions of a database: the sandbox uid needs access to them as to the database.
_SQLITE_SIDECARS = ("", "-wal", "-shm", "-journal")
