"""Nothing a sandbox wrote is trusted at start-up (issue 35, item 5).

Before issue 26 the email database lived at DATA_PATH/<user>/emails.db, a folder every
sandbox of that user writes. Start-up used to move it to ``sandbox.email_db``, copying it
when that lay on another filesystem: a tool's 1-TiB sparse ``emails.db`` then filled the
mail filesystem, blocked listening, left ``emails.db.partial`` behind and became the
user's real database. Now start-up takes nothing from there. Real daemon, real Docker, the
email folder on a small ext4 on a loop device that the test makes and always removes.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.e2e.conftest import Daemon

pytestmark = pytest.mark.docker

ALICE = "alice@example.com"
SPARSE_SIZE = 1 << 40  # 1 TiB, 0 blocks on the host
MAIL_FS_SIZE = 64 << 20


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def mail_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64-MiB ext4 on a loop device, mounted; unmounted and detached whatever the test did."""
    if os.geteuid() != 0:
        pytest.skip("needs root: makes a loop device and mounts it")
    image, mount = tmp_path / "mail.img", tmp_path / "mail"
    with open(image, "wb") as f:
        f.truncate(MAIL_FS_SIZE)
    _run("mkfs.ext4", "-q", "-F", str(image))
    mount.mkdir()
    device = _run("losetup", "--find", "--show", str(image))
    try:
        _run("mount", device, str(mount))
        try:
            yield mount
        finally:
            _run("umount", str(mount))
    finally:
        _run("losetup", "-d", device)
        image.unlink()


def _timestamp(line: str) -> datetime:
    return datetime.fromisoformat(json.loads(line)["timestamp"])


def _used_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_planted_sparse_database_is_neither_copied_nor_trusted_at_start(make_daemon: Any, mail_fs: Path) -> None:
    daemon: Daemon = make_daemon(config=f"sandbox:\n  email_db: \"{mail_fs}/{{user}}/emails.db\"\n", start=False)
    (mail_fs / ALICE).mkdir(mode=0o700)  # the operator's folder for alice, still empty
    # What a tool could leave in /officer/user: `truncate -s 1T emails.db emails.db-wal`.
    planted = [daemon.data / ALICE / "emails.db", daemon.data / ALICE / "emails.db-wal"]
    planted[0].parent.mkdir(parents=True)
    for path in planted:
        with open(path, "wb") as f:
            f.truncate(SPARSE_SIZE)
    used = _used_bytes(mail_fs)
    began = time.monotonic()
    daemon.start()
    wall = time.monotonic() - began  # the interpreter's start included
    # The daemon's own start-up, from its first log line to listening (the old copy ran in between).
    first = next(_timestamp(line) for line in daemon.log_path.read_text().splitlines() if line.startswith("{"))
    startup = (datetime.fromisoformat(daemon.events("listening")[0]["timestamp"]) - first).total_seconds()
    assert startup < 1.0, f"listening {startup:.2f} s after the first log line:\n{daemon.log()}"
    # The mail filesystem is as it was: nothing copied, no partial file, no database made from the plant.
    assert _used_bytes(mail_fs) - used < 1 << 20, (used, _used_bytes(mail_fs))
    assert sorted(p.name for p in mail_fs.rglob("*") if p.name != "lost+found") == [ALICE]
    assert not list(daemon.data.rglob("*.partial"))
    assert all(os.stat(p).st_size == SPARSE_SIZE for p in planted)  # left where the tool put them
    assert not daemon.events("email_db_migrated") and not daemon.events("email_db_migration_failed")
    print(f"\nwith a planted 1-TiB emails.db and -wal: listening {startup:.3f} s after the daemon's first log line, "
          f"{wall:.3f} s after exec")
