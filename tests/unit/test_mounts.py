"""Bind sources no sandbox can redirect (sandbox/mounts.py), and the email database's place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxd.config import AUTO_SANDBOX_ID, email_db_path, load_config
from sandboxd.container import CONTAINER_EMAIL_DIR, CONTAINER_USER, CONTAINER_USER_TOOLS
from sandboxd.errors import ConfigError, UnsafeMount
from sandboxd.sandbox.backend import SandboxSpec
from sandboxd.sandbox.mounts import (ACCESS_ACL, DEFAULT_ACL, R, W, X, acl_users, grant_access,
                                     open_beneath, sandbox_binds)

ALICE, MALLORY = "alice@example.com", "mallory@example.com"
UID = AUTO_SANDBOX_ID


def spec(data: Path, user: str) -> SandboxSpec:
    config = load_config(environ={}, overrides={"data_path": data})
    return SandboxSpec(user, data / "tools", data / user, data / user / "tools", email_db_path(config, user), root=data)


def make_db(path: Path, text: str = "db") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_the_default_email_db_is_outside_the_user_data_folder(tmp_path: Path) -> None:
    config = load_config(environ={}, overrides={"data_path": tmp_path})
    path = email_db_path(config, ALICE)
    assert path == tmp_path / "email" / ALICE / "emails.db"
    assert not path.is_relative_to(tmp_path / ALICE)


@pytest.mark.parametrize(("template", "fragment"), [
    ("{data_path}/{user}/emails.db", "inside a user's data folder"),
    ("{data_path}/{user}.d/emails.db", "inside a user's data folder"),  # "alice@x.d" would be a user too
    ("{data_path}/shared.db", "must contain {user}"),
    ("mail/{user}.db", "absolute path"),
    ("{home}/{user}.db", "only {data_path} and {user}"),
    # The folder is what a sandbox mounts: one per user, the file named as tools open it.
    ("{data_path}/mail/{user}.db", "must name a file 'emails.db'"),
    ("{data_path}/email/{user}/mail.sqlite", "must name a file 'emails.db'"),
    ("{data_path}/email/{user}/../emails.db", "must put {user} in the folder's name"),
    ("{data_path}/tools/{user}/emails.db", "inside DATA_PATH/tools, which every user's sandboxes mount"),
])
def test_an_email_db_template_a_sandbox_could_reach_is_refused(tmp_path: Path, template: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="sandbox.email_db") as info:
        load_config(environ={}, overrides={"data_path": tmp_path, "sandbox": {"email_db": template}})
    assert fragment in str(info.value)


def test_binds_are_checked_paths_and_the_sandbox_uid_gets_access(tmp_path: Path) -> None:
    make_db(tmp_path / "email" / ALICE / "emails.db")
    make_db(tmp_path / "email" / ALICE / "emails.db-wal")
    binds, warnings = sandbox_binds(spec(tmp_path, ALICE), UID)
    assert warnings == []
    by_target = {bind.target: bind for bind in binds}
    assert by_target[CONTAINER_USER].source == str(tmp_path.resolve() / ALICE)
    # The database's folder, not the file: its journal and WAL are the host's own files.
    assert by_target[CONTAINER_EMAIL_DIR].source == str(tmp_path.resolve() / "email" / ALICE)
    assert not by_target[CONTAINER_EMAIL_DIR].read_only
    assert by_target[CONTAINER_USER_TOOLS].read_only and not by_target[CONTAINER_USER].read_only
    # Made 0700: nobody but the daemon and, by the ACL, the sandbox uid enters a user's folder.
    # (The mode's group bits show the ACL's mask; the group entry itself stays empty.)
    assert (tmp_path / ALICE).stat().st_mode & 0o707 == 0o700
    assert acl_users(tmp_path / ALICE) == {UID: R | W | X}
    assert acl_users(tmp_path / ALICE, DEFAULT_ACL)[UID] == R | W | X
    assert acl_users(tmp_path / "tools") == {UID: R | X}
    assert acl_users(tmp_path / "email" / ALICE) == {UID: R | W | X}
    assert acl_users(tmp_path / "email" / ALICE, DEFAULT_ACL)[UID] == R | W | X
    assert acl_users(tmp_path / "email" / ALICE / "emails.db") == {UID: R | W}
    assert acl_users(tmp_path / "email" / ALICE / "emails.db-wal") == {UID: R | W}


def test_without_a_database_its_folder_is_made_and_mounted(tmp_path: Path) -> None:
    # So that a database the mail sync makes later is there at the sandbox's next call.
    binds, warnings = sandbox_binds(spec(tmp_path, ALICE), UID)
    assert warnings == []
    folder = tmp_path / "email" / ALICE
    assert {bind.target: bind.source for bind in binds}[CONTAINER_EMAIL_DIR] == str(folder.resolve())
    assert folder.is_dir() and folder.stat().st_mode & 0o707 == 0o700
    assert acl_users(folder, DEFAULT_ACL)[UID] == R | W | X


def test_a_folder_outside_the_data_path_is_never_made(tmp_path: Path) -> None:
    config = load_config(environ={}, overrides={"data_path": tmp_path / "data",
                                                "sandbox": {"email_db": str(tmp_path / "mail/{user}/emails.db")}})
    data = tmp_path / "data"
    missing = SandboxSpec(ALICE, data / "tools", data / ALICE, data / ALICE / "tools", email_db_path(config, ALICE),
                          root=data)
    binds, _ = sandbox_binds(missing, UID)
    assert CONTAINER_EMAIL_DIR not in {bind.target for bind in binds}
    assert not (tmp_path / "mail").exists()
    make_db(tmp_path / "mail" / ALICE / "emails.db")
    binds, _ = sandbox_binds(missing, UID)
    assert {b.target: b.source for b in binds}[CONTAINER_EMAIL_DIR] == str((tmp_path / "mail" / ALICE).resolve())


def test_an_email_folder_that_is_a_link_to_another_users_is_refused(tmp_path: Path) -> None:
    make_db(tmp_path / "email" / ALICE / "emails.db", "alice's mail")
    (tmp_path / "email" / MALLORY).symlink_to(ALICE)
    with pytest.raises(UnsafeMount, match=f"{MALLORY} is a symbolic link"):
        sandbox_binds(spec(tmp_path, MALLORY), UID)


def test_a_link_inside_the_email_folder_is_never_followed(tmp_path: Path) -> None:
    # A tool can make files in its /officer/data, links included: mallory's sandbox plants
    # "emails.db" and "emails.db-wal" pointing at alice's database. Inside a sandbox such a
    # link resolves in the sandbox's own mounts; on the host the daemon never follows it.
    victim = make_db(tmp_path / "email" / ALICE / "emails.db", "alice's mail")
    (tmp_path / "email" / MALLORY).mkdir(parents=True)
    (tmp_path / "email" / MALLORY / "emails.db").symlink_to(victim)
    os.mkfifo(tmp_path / "email" / MALLORY / "emails.db-wal")
    binds, warnings = sandbox_binds(spec(tmp_path, MALLORY), UID)
    assert {b.target: b.source for b in binds}[CONTAINER_EMAIL_DIR] == str((tmp_path / "email" / MALLORY).resolve())
    assert acl_users(victim) == {}  # no access was granted through the link
    assert len(warnings) == 2
    assert "emails.db: a symbolic link, not followed" in warnings[0] and "mail sync must not follow" in warnings[0]
    assert "emails.db-wal: not a regular file" in warnings[1]


def test_an_operators_grant_to_the_mail_sync_is_kept(tmp_path: Path) -> None:
    # setfacl -m u:3000:rwx,d:u:3000:rw on the folder: the daemon adds the sandbox uid beside it.
    folder = tmp_path / "email" / ALICE
    folder.mkdir(parents=True, mode=0o700)
    sync = 3000
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        grant_access(fd, sync, R | W | X, inherit=True)
        grant_access(fd, UID, R | W | X, inherit=True)
        again = os.getxattr(fd, ACCESS_ACL)
        grant_access(fd, UID, R | W | X, inherit=True)  # nothing changes the second time
        assert os.getxattr(fd, ACCESS_ACL) == again
    finally:
        os.close(fd)
    assert acl_users(folder) == {sync: R | W | X, UID: R | W | X}
    assert acl_users(folder, DEFAULT_ACL) == {sync: R | W | X, UID: R | W | X, os.geteuid(): R | W | X}
    assert folder.stat().st_mode & 0o777 == 0o770  # the mask lets both have it; "other" still gets nothing


def test_a_user_tools_folder_that_became_a_link_is_refused(tmp_path: Path) -> None:
    (tmp_path / ALICE / "tools").mkdir(parents=True)
    (tmp_path / MALLORY).mkdir()
    (tmp_path / MALLORY / "tools").symlink_to(tmp_path / ALICE / "tools")
    with pytest.raises(UnsafeMount, match="tools is a symbolic link"):
        sandbox_binds(spec(tmp_path, MALLORY), UID)


def test_a_link_anywhere_below_the_root_is_refused(tmp_path: Path) -> None:
    make_db(tmp_path / "elsewhere" / ALICE / "emails.db")
    (tmp_path / "email").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UnsafeMount, match="email is a symbolic link"):
        open_beneath(tmp_path, tmp_path / "email" / ALICE / "emails.db", "file")


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "emails.db")
    with pytest.raises(UnsafeMount, match="not a regular file"):
        open_beneath(tmp_path, tmp_path / "emails.db", "file", flags=os.O_RDONLY)


def test_the_operators_own_link_above_the_root_is_followed(tmp_path: Path) -> None:
    real = tmp_path / "real"
    make_db(real / "email" / ALICE / "emails.db")
    (tmp_path / "data").symlink_to(real)
    fd, checked = open_beneath(tmp_path / "data", tmp_path / "data" / "email" / ALICE / "emails.db", "file")
    os.close(fd)
    assert checked == str(real.resolve() / "email" / ALICE / "emails.db")


def test_docs_recipe_a_mail_sync_user_granted_on_the_email_root_reaches_every_users_folder(tmp_path: Path) -> None:
    # docs/install.md: `setfacl -m u:SYNC:rwx,d:u:SYNC:rwx DATA_PATH/email` before the daemon makes
    # the users' folders. A folder made 0700 inherits the entry with an empty mask; the daemon's
    # grant widens the mask, so the sync's entry works too.
    sync = 3000
    root = tmp_path / "email"
    root.mkdir(mode=0o700)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        grant_access(fd, sync, R | W | X, inherit=True)
    finally:
        os.close(fd)
    sandbox_binds(spec(tmp_path, ALICE), UID)
    folder = root / ALICE
    assert {sync: R | W | X, UID: R | W | X}.items() <= acl_users(folder).items()
    assert acl_users(folder, DEFAULT_ACL)[sync] == R | W | X
    assert folder.stat().st_mode & 0o070 == 0o070  # the mask: both entries take effect
