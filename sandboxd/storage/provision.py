"""A user's folders made quota subvolumes: where that can hold, the provisioning itself, and the helper's door.

Runs as root: in a daemon that is root, in ``sandboxd run --user`` run by root, or in the
privileged helper (helper.py) for an unprivileged daemon, which asks it through ``helper_client.ask_helper``.
Every step works on handles opened below the area's root without following links
(btrfs.py); a plain folder found where a subvolume belongs is converted (convert.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from sandboxd.config import AUTO_SANDBOX_ID, Config, email_db_path
from sandboxd.container import CONTAINER_EMAIL_DIR, CONTAINER_USER
from sandboxd.errors import BackendUnavailable
from sandboxd.logging import get_logger
from sandboxd.sandbox.mounts import R, W, X, grant_access
from sandboxd.storage import btrfs, convert
from sandboxd.users import check_user

log = get_logger("sandboxd.storage")

SANDBOX_PATHS = {"data": CONTAINER_USER, "email": CONTAINER_EMAIL_DIR}  # where each area's folder is in a sandbox
_PROBE = "probe@example.invalid"


@dataclass(frozen=True)
class Area:
    """One place users' folders live: ``root`` holds one folder per user (``folder(user)``)."""

    name: str  # data | email
    root: Path
    per_user_root: bool  # False: each user's folder lies elsewhere (an email template like /srv/{user}/mail/)

    def folder(self, config: Config, user: str) -> Path:
        if self.name == "data":
            return config.data_path / user
        return email_db_path(config, user).parent


def areas(config: Config) -> list[Area]:
    email = email_db_path(config, _PROBE).parent
    shared = email_db_path(config, "other-" + _PROBE).parent.parent == email.parent
    return [Area("data", config.data_path, True), Area("email", email.parent, shared)]


def hard_problem(area: Area, *, privileged: bool) -> tuple[str | None, str | None]:
    """(None, fs id) when ``area`` can be enforced by the kernel, else (why not and the fix, None)."""
    if not area.per_user_root:
        return (f"sandbox.email_db puts each user's email folder under a folder of that user's own ({area.root}); "
                "use the default layout, {data_path}/email/{user}/emails.db", None)
    try:
        fd = os.open(area.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"{area.root} does not exist; create it on a btrfs filesystem", None
    try:
        fs_id = btrfs.filesystem_id(fd)
    finally:
        os.close(fd)
    if fs_id is None:
        return (f"{area.root} is not on a btrfs filesystem; put it on one with quota enabled "
                "(docs/install.md, 'Disk quotas')", None)
    if not btrfs.quota_enabled(fs_id):
        return f"btrfs quota is not enabled on {area.root}; run: btrfs quota enable {area.root}", None
    if not privileged:
        return ("setting a qgroup limit needs root: run sandboxd as root, or install and start the helper "
                "(make install; systemctl enable --now sandboxd-quota.socket)", None)
    return None, fs_id


def provision_user(config: Config, user: str, owner: tuple[int, int]) -> dict[str, str]:
    """Make ``user``'s folders subvolumes under one qgroup limited to their quota; area → what holds.

    Runs as root (in the daemon, or in the helper for ``owner``, the daemon's uid and gid,
    which then owns the folders it made). Each place that is not btrfs with quota is left
    alone ("soft"). A plain folder, made before the quota (an operator's ``mkdir`` or ``cp -r``),
    is converted into a subvolume under the limit (convert.py), or ConversionFailed names the fix.
    """
    user = check_user(user)
    limit_bytes, _ = config.storage.limits(user)
    uid = sandbox_uid(config)
    groups: dict[str, int] = {}  # fs id → the user's qgroup on it
    done: dict[str, str] = {}
    for area in areas(config):
        problem, fs_id = hard_problem(area, privileged=True)
        if problem is not None or fs_id is None:
            done[area.name] = "soft"
            continue
        root_fd = os.open(area.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        tools = area.name == "data"
        try:
            group = _provision_folder(
                root_fd, area.folder(config, user).name, owner,
                lambda fd: _join_group(root_fd, fd, fs_id, groups, limit_bytes),
                lambda fd: _prepare_for_sandboxes(fd, uid, owner, tools=tools))
        finally:
            os.close(root_fd)
        done[area.name] = f"hard:{fs_id}:{group}"
    return done


def new_user_folder(config: Config, area: Area, name: str, user: str, owner: tuple[int, int],
                    groups: dict[str, int], *, privileged: bool) -> tuple[int, bool]:
    """A new, empty folder ``name`` in ``area.root``, made as ``user``'s own are: where the area can be enforced
    (and ``privileged``), a subvolume in the user's limited qgroup, ``groups`` holding it for the user's next
    folder on the filesystem; else a plain folder (the first call converts it: convert.py). Its handle, and
    whether it is a subvolume. FileExistsError when ``name`` exists.

    An import fills it, then renames it to the user's folder: the kernel counts every byte it writes."""
    problem, fs_id = hard_problem(area, privileged=privileged)
    hard = config.storage.enforcement != "off" and problem is None and fs_id is not None
    root_fd = os.open(area.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if hard and fs_id is not None:
            fd, created = btrfs.open_subvolume(root_fd, name, create=True)
            if not created:
                os.close(fd)
                raise FileExistsError(f"{area.root / name} exists")
            _join_group(root_fd, fd, fs_id, groups, config.storage.limits(user)[0])
        else:
            os.mkdir(name, 0o700, dir_fd=root_fd)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)
        os.fchmod(fd, 0o700)
        _prepare_for_sandboxes(fd, sandbox_uid(config), owner, tools=area.name == "data")
        os.fchown(fd, *owner)
    finally:
        os.close(root_fd)
    return fd, hard


def sandbox_uid(config: Config) -> int:
    setting = config.sandbox.user
    return int((f"{AUTO_SANDBOX_ID}" if setting == "auto" else setting).split(":")[0])


def _provision_folder(root_fd: int, name: str, owner: tuple[int, int], join: Callable[[int], int],
                      prepare: Callable[[int], None]) -> int:
    """The subvolume ``name`` in ``root_fd`` made (or a plain folder converted) and joined to its qgroup; the qgroup."""

    def finish(fd: int) -> None:  # the daemon owns what it mounts, and sets its ACLs (mounts.py)
        os.fchmod(fd, 0o700)  # first: once chowned, the helper would need CAP_FOWNER for it
        prepare(fd)
        os.fchown(fd, *owner)

    try:
        fd, created = btrfs.open_subvolume(root_fd, name, create=True)
    except btrfs.NotASubvolume:
        fd, created = convert.to_subvolume(root_fd, name, join, finish), False
    try:
        if created:
            finish(fd)
        return join(fd)
    finally:
        os.close(fd)


def _prepare_for_sandboxes(fd: int, sandbox_uid: int, owner: tuple[int, int], *, tools: bool) -> None:
    """What a sandbox's start writes in a user's folder (mounts.py), written now, while the quota cannot refuse it.

    A folder filled to its quota has no room for a new ACL or a ``tools`` folder; a user whose
    sandboxes all ended could then never start one to delete files. Best effort: whatever fails
    here, the sandbox's start tries again and says why.
    """
    try:
        grant_access(fd, sandbox_uid, R | W | X, inherit=True)
        if not tools:
            return
        try:
            os.mkdir("tools", 0o755, dir_fd=fd)
            made = True
        except FileExistsError:
            made = False
        tools_fd = os.open("tools", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        try:
            grant_access(tools_fd, sandbox_uid, R | X, inherit=True)
            if made:
                os.fchown(tools_fd, *owner)
        finally:
            os.close(tools_fd)
    except (OSError, BackendUnavailable) as exc:
        log.warning("storage_prepare_failed", error=str(exc))


def _join_group(root_fd: int, fd: int, fs_id: str, groups: dict[str, int], limit_bytes: int) -> int:
    """Put the subvolume ``fd`` in the user's limited qgroup on ``fs_id`` (made with the first); the qgroup."""
    subvolume = btrfs.subvolume_id(fd)
    group = groups.get(fs_id)
    if group is None:
        group = groups[fs_id] = btrfs.qgroup_id(1, subvolume)
        btrfs.create_qgroup(root_fd, group)
        btrfs.limit_qgroup(root_fd, group, limit_bytes)
    btrfs.assign_qgroup(root_fd, btrfs.qgroup_id(0, subvolume), group)
    return group
