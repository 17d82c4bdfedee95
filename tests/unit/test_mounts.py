"""Bind sources no sandbox can redirect (sandbox/mounts.py), the email database's place, its migration."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sandboxd.config import AUTO_SANDBOX_ID, email_db_path, load_config
from sandboxd.errors import ConfigError, UnsafeMount
from sandboxd.sandbox.backend import CONTAINER_EMAIL_DB, CONTAINER_USER, CONTAINER_USER_TOOLS, SandboxSpec
from sandboxd.sandbox.mounts import DEFAULT_ACL, R, W, X, acl_users, migrate_email_db, open_beneath, sandbox_binds

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
])
def test_an_email_db_template_a_sandbox_could_reach_is_refused(tmp_path: Path, template: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="sandbox.email_db") as info:
        load_config(environ={}, overrides={"data_path": tmp_path, "sandbox": {"email_db": template}})
    assert fragment in str(info.value)


def test_binds_are_checked_paths_and_the_sandbox_uid_gets_access(tmp_path: Path) -> None:
    make_db(tmp_path / "email" / ALICE / "emails.db")
    binds, warnings = sandbox_binds(spec(tmp_path, ALICE), UID)
    assert warnings == []
    by_target = {bind.target: bind for bind in binds}
    assert by_target[CONTAINER_USER].source == str(tmp_path.resolve() / ALICE)
    assert by_target[CONTAINER_EMAIL_DB].source == str(tmp_path.resolve() / "email" / ALICE / "emails.db")
    assert by_target[CONTAINER_USER_TOOLS].read_only and not by_target[CONTAINER_USER].read_only
    # Made 0700: nobody but the daemon and, by the ACL, the sandbox uid enters a user's folder.
    # (The mode's group bits show the ACL's mask; the group entry itself stays empty.)
    assert (tmp_path / ALICE).stat().st_mode & 0o707 == 0o700
    assert acl_users(tmp_path / ALICE) == {UID: R | W | X}
    assert acl_users(tmp_path / ALICE, DEFAULT_ACL)[UID] == R | W | X
    assert acl_users(tmp_path / "tools") == {UID: R | X}
    assert acl_users(tmp_path / "email" / ALICE / "emails.db") == {UID: R | W}


def test_without_a_database_nothing_is_mounted_at_its_place(tmp_path: Path) -> None:
    binds, _ = sandbox_binds(spec(tmp_path, ALICE), UID)
    assert CONTAINER_EMAIL_DB not in {bind.target for bind in binds}


def test_an_email_db_that_is_a_link_to_another_users_database_is_refused(tmp_path: Path) -> None:
    # The attack, at the database's new place: whoever made the link, it is never followed.
    make_db(tmp_path / "email" / ALICE / "emails.db", "alice's mail")
    (tmp_path / "email" / MALLORY).mkdir(parents=True)
    (tmp_path / "email" / MALLORY / "emails.db").symlink_to(f"../{ALICE}/emails.db")
    with pytest.raises(UnsafeMount, match="emails.db is a symbolic link"):
        sandbox_binds(spec(tmp_path, MALLORY), UID)


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


def test_a_legacy_database_moves_once_with_its_wal(tmp_path: Path) -> None:
    legacy = make_db(tmp_path / ALICE / "emails.db", "mail")
    make_db(tmp_path / ALICE / "emails.db-wal", "wal")
    target = tmp_path / "email" / ALICE / "emails.db"
    assert migrate_email_db(legacy, target) == f"moved {legacy} to {target}"
    assert target.read_text() == "mail" and Path(f"{target}-wal").read_text() == "wal"
    assert not legacy.exists()
    # Once: a new file at the old place (a tool's own) is never taken for the database.
    make_db(legacy, "a tool's file")
    assert migrate_email_db(legacy, target) is None
    assert target.read_text() == "mail"


def test_a_legacy_link_is_left_where_it_is(tmp_path: Path) -> None:
    make_db(tmp_path / ALICE / "emails.db", "alice's mail")
    (tmp_path / MALLORY).mkdir()
    legacy = tmp_path / MALLORY / "emails.db"
    legacy.symlink_to(f"../{ALICE}/emails.db")
    target = tmp_path / "email" / MALLORY / "emails.db"
    assert "not a regular file" in (migrate_email_db(legacy, target) or "")
    assert not os.path.lexists(target)
