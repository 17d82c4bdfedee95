"""No mount source comes from a tree a sandbox can write (issue 11, item 1), and tools run as nobody (item 4).

The attack: a user's tool turns `/officer/user/emails.db` into a link to another user's
database and crashes; the pool replaces its sandbox, and the daemon, following the link,
mounts the victim's mail into the attacker's next sandbox. Real daemon, real Docker.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest

from sandboxd.client import RpcError
from sandboxd.config import AUTO_SANDBOX_ID
from sandboxd.sandbox.mounts import acl_users

from tests.e2e.conftest import Daemon
from tests.e2e.hostile_harness import call, install_hostile_tools

pytestmark = pytest.mark.docker

ALICE, MALLORY = "alice@example.com", "mallory@example.com"
SECRET = "alice-private-mail-7f3a"


def started(make_daemon: Any) -> Daemon:
    daemon = make_daemon(start=False)
    install_hostile_tools(daemon)
    return daemon


def make_mail(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(path) as db:
        db.execute("create table m (s text)")
        db.execute("insert into m values (?)", (text,))
    return path


def mail_seen_by(daemon: Daemon, user: str) -> str:
    with daemon.client() as client:
        report = call(client, user, "fs_probe", {"read": "/officer/data/emails.db"})["details"]
    return report["read /officer/data/emails.db"]


def test_a_link_planted_in_the_user_folder_never_reaches_another_users_mail(make_daemon: Any) -> None:
    daemon = started(make_daemon)
    make_mail(daemon.data / "email" / ALICE / "emails.db", SECRET)
    daemon.start()
    assert SECRET in mail_seen_by(daemon, ALICE)
    with daemon.client() as client:
        crashed = call(client, MALLORY, "link_planter", {"victim": ALICE, "crash": True})
        assert crashed["status"] == "crashed", crashed
        # The replaced sandbox: the links are there, and the tools mount cannot be swapped.
        report = call(client, MALLORY, "link_planter", {"victim": ALICE})["details"]
    assert report["rename tools"] == "EBUSY" and report["rmdir tools"] == "EBUSY", report
    assert report["replace tools"] == "EEXIST", report
    assert os.path.islink(daemon.data / MALLORY / "emails.db")
    seen = mail_seen_by(daemon, MALLORY)
    assert seen == "ENOENT" and SECRET not in seen


def test_links_a_tool_plants_in_its_email_folder_are_never_followed_by_the_daemon(make_daemon: Any) -> None:
    # /officer/data is mallory's email folder on the host, writable: she can plant links there
    # (a FIFO too). Her next sandbox still starts; the daemon grants access on nothing it did
    # not open as a regular file there, and names each planted entry in the log.
    daemon = started(make_daemon)
    victim = make_mail(daemon.data / "email" / ALICE / "emails.db", SECRET)
    outside = daemon.tmp / "host-only.txt"
    outside.write_text("the host's own")
    outside.chmod(0o600)
    daemon.start()
    with daemon.client() as client:
        crashed = call(client, MALLORY, "mail_link_planter",
                       {"database": str(victim), "journal": str(outside), "crash": True})
        assert crashed["status"] == "crashed", crashed
        report = call(client, MALLORY, "fs_probe", {"read": "/officer/data/emails.db,/officer/data"})["details"]
    assert os.path.islink(daemon.data / "email" / MALLORY / "emails.db")
    assert report["read /officer/data/emails.db"] == "ENOENT"  # resolved in the sandbox, where that path is not
    assert SECRET not in json.dumps(report)
    assert acl_users(outside) == {} and outside.read_text() == "the host's own"
    problems = " | ".join(e["problem"] for e in daemon.events("sandbox_mount_access", user=MALLORY))
    assert "emails.db: a symbolic link, not followed" in problems, problems
    assert "emails.db-journal: a symbolic link, not followed" in problems, problems
    assert "emails.db-wal: not a regular file" in problems, problems
    assert SECRET in mail_seen_by(daemon, ALICE)


def test_a_database_at_the_old_place_is_neither_moved_nor_mounted(make_daemon: Any) -> None:
    # DATA_PATH/<user>/emails.db was the default before issue 26. Sandboxes write that folder,
    # so whatever is there may be a tool's: start-up leaves it, and no sandbox mounts it as mail.
    daemon = started(make_daemon)
    legacy = make_mail(daemon.data / ALICE / "emails.db", SECRET)
    daemon.start()
    assert legacy.is_file() and not os.path.lexists(daemon.data / "email" / ALICE / "emails.db")
    assert mail_seen_by(daemon, ALICE) == "ENOENT"


def test_a_user_tools_folder_that_is_a_link_is_refused_by_name(make_daemon: Any) -> None:
    daemon = started(make_daemon)
    (daemon.data / ALICE / "tools").mkdir(parents=True)
    (daemon.data / MALLORY).mkdir()
    (daemon.data / MALLORY / "tools").symlink_to(daemon.data / ALICE / "tools")
    daemon.start()
    with daemon.client() as client:
        with pytest.raises(RpcError) as info:
            call(client, MALLORY, "hello", {"name": "x"})
        assert call(client, ALICE, "hello", {"name": "alice"})["status"] == "ok"
    assert info.value.code == -32002
    assert "tools is a symbolic link" in info.value.message and "refuses to mount" in info.value.message


def test_tools_run_as_a_uid_that_is_nobody_on_the_host(make_daemon: Any, docker_api: Any) -> None:
    daemon = started(make_daemon)
    daemon.start()
    with daemon.client() as client:
        report = call(client, MALLORY, "escalator")["details"]
        wrote = call(client, MALLORY, "fs_probe", {"write": "/officer/user/made.txt"})["details"]
    assert report["uid"] == str(AUTO_SANDBOX_ID)
    assert wrote["write /officer/user/made.txt"] == "ok"
    made = (daemon.data / MALLORY / "made.txt").stat()
    assert (made.st_uid, made.st_gid) == (AUTO_SANDBOX_ID, AUTO_SANDBOX_ID)
    with pytest.raises(KeyError):
        pwd.getpwuid(AUTO_SANDBOX_ID)  # no account: a file it owns gives nobody on the host anything
    assert AUTO_SANDBOX_ID not in (0, 1000, os.geteuid())
    # The containers the daemon made say so too.
    containers = daemon.containers(docker_api, **{"org.sandboxd.user": MALLORY})
    assert containers
    for container in containers:
        assert docker_api.api.inspect_container(container["Id"])["Config"]["User"] == f"{AUTO_SANDBOX_ID}:{AUTO_SANDBOX_ID}"
    # Only the daemon and the sandbox uid may enter the user's folder.
    assert (daemon.data / MALLORY).stat().st_mode & 0o007 == 0


def mount_options(mountinfo: str, target: str) -> set[str]:
    """The per-mount options of ``target`` in a /proc/self/mountinfo text."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[4] == target:
            return set(fields[5].split(","))
    raise AssertionError(f"{target} is not mounted:\n{mountinfo}")


def test_on_a_nosuid_nodev_data_path_the_writable_mounts_are_too(make_daemon: Any) -> None:
    daemon = started(make_daemon)
    tools = {p.name: p for p in (daemon.data / "tools").iterdir()}
    staged = daemon.tmp / "staged-tools"
    shutil.copytree(daemon.data / "tools", staged)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "nosuid,nodev,size=64m", "tmpfs", str(daemon.data)],
                           capture_output=True, text=True)
    assert mount.returncode == 0, f"the e2e suite runs as root (CI does): {mount.stderr}"
    try:
        shutil.copytree(staged, daemon.data / "tools")
        assert set(p.name for p in (daemon.data / "tools").iterdir()) == set(tools)
        make_mail(daemon.data / "email" / MALLORY / "emails.db", "mallory's own mail")
        daemon.start()
        with daemon.client() as client:
            report = call(client, MALLORY, "fs_probe", {"read": "/proc/self/mountinfo"})["details"]
        mountinfo = report["read /proc/self/mountinfo"].removeprefix("ok:")
        for target in ("/officer/user", "/officer/data"):
            assert {"nosuid", "nodev"} <= mount_options(mountinfo, target), target
        assert '"event": "data_path_allows_setuid"' not in daemon.log_path.read_text()
    finally:
        daemon.stop()
        subprocess.run(["umount", "-l", str(daemon.data)], check=False)


def test_a_data_path_that_allows_setuid_files_is_named_at_start(make_daemon: Any) -> None:
    daemon = make_daemon()
    flags = os.statvfs(daemon.data).f_flag
    warned = '"event": "data_path_allows_setuid"' in daemon.log_path.read_text()
    assert warned == (not (flags & os.ST_NOSUID and flags & os.ST_NODEV))
