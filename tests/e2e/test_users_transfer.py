"""`sandboxd users export` / `users import` between two real daemons (issue 46, item 4), and hostile archives.

The move: daemon A and daemon B, each with its data path on a btrfs loop filesystem of its own
under a hard quota. A's user has a 64-MiB file their own tool wrote, 200 small files, that tool,
and an email database in WAL mode whose writer (the test, standing in for the mail sync) keeps
committed rows un-checkpointed in the WAL. Exported from A with the CLI, imported into B: every
checksum and every row match, the tool runs on B, and B's kernel holds the user at the same
quota (a 200-MiB write stops at it). The hostile archives go through the CLI against one daemon,
each refused with exit 1 naming the entry, nothing of the user left. 67 s at a load of 11 on 2 cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import zstandard

from sandboxd.storage import btrfs
from sandboxd.storage.transfer.export import stream, take_snapshot
from sandboxd.config import Config, StorageConfig

from tests.e2e.conftest import Daemon, write_tool
from tests.e2e.test_hard_quota_kept import FILL, FILL_INPUTS
from tests.loopfs import MIB, loop_devices_usable, loop_filesystem
from tests.unit.test_users_transfer import CASES, USER, hostile, make_user, members

pytestmark = [pytest.mark.docker, pytest.mark.skipif(bool(loop_devices_usable("btrfs")),
                                                     reason=str(loop_devices_usable("btrfs")))]

QUOTA_MIB = 160
HARD = f"""
pool:
  max_per_user: 1
  min_idle: 0
storage:
  enforcement: hard
  quota_bytes: {QUOTA_MIB}m
  quota_inodes: 5000
"""

MOVED = "moved@example.com"


def cli(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "sandboxd", *args], input=stdin, capture_output=True, timeout=300,
                          check=False, env={k: v for k, v in os.environ.items() if not k.startswith("SANDBOXD_")})


def tree(folder: Path) -> dict[str, tuple[str, int]]:
    """Every entry below ``folder``: (sha256, link target or 'dir'; its mode)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        what = (os.readlink(path) if path.is_symlink() else "dir" if path.is_dir()
                else hashlib.sha256(path.read_bytes()).hexdigest())
        found[str(path.relative_to(folder))] = (what, info.st_mode & 0o7777)
    return found


def call(daemon: Daemon, user: str, tool: str, arguments: dict[str, Any]) -> str:
    with daemon.client() as client:
        result = client.call_tool(user, tool, arguments, timeoutMs=120_000)
    return "\n".join(block["text"] for block in result["content"])


def qgroup_limit(folder: Path) -> int:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fs_id, subvolume = btrfs.filesystem_id(fd), btrfs.subvolume_id(fd)
    finally:
        os.close(fd)
    assert fs_id is not None and os.lstat(folder).st_ino == btrfs.SUBVOLUME_ROOT_INO, f"{folder} is no subvolume"
    usage = btrfs.qgroup_usage(fs_id, btrfs.qgroup_id(1, subvolume))
    assert usage is not None, f"{folder} has no qgroup of its own"
    return usage[1]


def open_writer(db_path: Path) -> sqlite3.Connection:
    """The mail sync's stand-in: WAL mode, no automatic checkpoint, 300 rows committed and left in the WAL."""
    writer = sqlite3.connect(db_path, isolation_level=None)
    assert writer.execute("PRAGMA journal_mode=WAL").fetchone() == ("wal",)
    writer.execute("PRAGMA wal_autocheckpoint=0")
    writer.execute("CREATE TABLE mail (id INTEGER PRIMARY KEY, subject TEXT, body BLOB)")
    writer.execute("BEGIN")
    writer.executemany("INSERT INTO mail (subject, body) VALUES (?, ?)",
                       [(f"mail {i}", os.urandom(300)) for i in range(300)])
    writer.execute("COMMIT")
    return writer


def test_a_user_exported_from_one_daemon_and_imported_into_another_keeps_every_byte_row_tool_and_quota(
        make_daemon: Any, tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "d0" / "data", "btrfs", 768), \
            loop_filesystem(tmp_path / "d1" / "data", "btrfs", 768):
        a, b = make_daemon(HARD, start=False), make_daemon(HARD, start=False)
        write_tool(a.data / MOVED / "tools", "my_fill", FILL, inputs=FILL_INPUTS)  # the user's own tool
        a.start()
        b.start()
        try:
            assert call(a, MOVED, "my_fill", {"file": "big", "mib": 64}) == "wrote 64 MiB"
            small = a.data / MOVED / "small"
            small.mkdir()
            for i in range(200):
                (small / f"{i:03}.txt").write_bytes(os.urandom(100 + i))
            os.symlink("small/007.txt", a.data / MOVED / "latest")
            writer = open_writer(a.data / "email" / MOVED / "emails.db")
            wal = a.data / "email" / MOVED / "emails.db-wal"
            assert wal.stat().st_size > 300 * 300, "the rows must be in the WAL, not yet in the database file"
            rows = writer.execute("SELECT id, subject, body FROM mail ORDER BY id").fetchall()
            before = tree(a.data / MOVED)

            archive = tmp_path / "moved.tar.zst"
            exported = cli("users", "export", MOVED, "--out", str(archive), "--socket", str(a.socket), "--json")
            assert exported.returncode == 0, exported.stderr.decode()
            summary = json.loads(exported.stdout)
            assert (summary["user"], summary["files"], summary["consistentBy"]) == (MOVED, 203, "btrfs snapshot")
            assert not list(a.data.glob("*~sandboxd-export*")), "the export's snapshot is left behind"
            writer.execute("INSERT INTO mail (subject) VALUES ('after the export')")  # the sync goes on writing

            imported = cli("users", "import", str(archive), "--socket", str(b.socket), "--json")
            assert imported.returncode == 0, imported.stderr.decode()
            assert json.loads(imported.stdout)["files"] == 203
            assert tree(b.data / MOVED) == before
            copy = sqlite3.connect(b.data / "email" / MOVED / "emails.db")
            assert copy.execute("SELECT id, subject, body FROM mail ORDER BY id").fetchall() == rows
            copy.close()
            writer.close()

            # B's kernel holds the user at the same limit, and their own tool runs there.
            assert qgroup_limit(b.data / MOVED) == qgroup_limit(a.data / MOVED) == QUOTA_MIB * MIB
            over = call(b, MOVED, "my_fill", {"file": "more", "mib": 200})
            assert "EDQUOT" in over and int(over.split()[1]) <= QUOTA_MIB - 64, over
            assert hashlib.sha256((b.data / MOVED / "big").read_bytes()).hexdigest() == before["big"][0]

            again = cli("users", "import", str(archive), "--socket", str(b.socket))
            assert again.returncode == 1 and f"already has data on this host: {b.data / MOVED}" in again.stderr.decode()
        finally:
            a.stop()
            b.stop()


# -- hostile archives, through the CLI against one daemon -------------------------------------------------------


@pytest.fixture(scope="module")
def soft_daemon(tmp_path_factory: pytest.TempPathFactory, docker_api: Any) -> Iterator[Daemon]:
    daemon = Daemon(tmp_path_factory.mktemp("hostile"), config="pool:\n  min_idle: 0\nstorage:\n  quota_bytes: 2m\n")
    daemon.start()
    yield daemon
    daemon.stop()
    daemon.remove_leftovers(docker_api)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    source = tmp_path_factory.mktemp("source")
    make_user(source)
    snap = take_snapshot(Config(data_path=source, storage=StorageConfig(enforcement="soft")), USER,
                         sandbox_uid=12345, freeze=False)
    try:
        return b"".join(stream(snap))
    finally:
        snap.close()


def left_of_user(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*") if USER in p.name or "sandboxd-import" in p.name]


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_archive_is_refused_naming_the_entry_with_nothing_left(soft_daemon: Daemon, exported: bytes,
                                                                         case: str) -> None:
    archive, entry = hostile(members(exported), case)
    refused = cli("users", "import", "-", "--socket", str(soft_daemon.socket), stdin=archive)
    assert refused.returncode == 1, refused.stderr.decode()
    assert f"refused at {entry!r}" in refused.stderr.decode()
    assert left_of_user(soft_daemon.data) == []


def stream_cases(exported: bytes) -> dict[str, tuple[bytes, str]]:
    """Archives wrong as a whole, and what the refusal says: cut short, not a tar, a zstd bomb."""
    in_a_file = exported.index(b"note 3") + 10
    zstd = zstandard.ZstdCompressor()
    return {"truncated": (exported[:in_a_file], "truncated"),
            "truncated_zstd": (zstd.compress(exported)[:-200], "truncated"),
            "not_a_tar": (b"PK\x03\x04" + bytes(range(256)) * 40, "not a tar"),
            # 256 MiB of zeros (past the 66-MiB bound) in a few KiB: read in bounded pieces, refused at its first block.
            "zstd_bomb": (zstd.compress(bytes(256 << 20)), "starts with manifest.json")}


@pytest.mark.parametrize("case", ["truncated", "truncated_zstd", "not_a_tar", "zstd_bomb"])
def test_an_archive_wrong_as_a_whole_is_refused_with_nothing_left(soft_daemon: Daemon, exported: bytes,
                                                                  case: str) -> None:
    archive, says = stream_cases(exported)[case]
    refused = cli("users", "import", "-", "--socket", str(soft_daemon.socket), stdin=archive)
    assert refused.returncode == 1 and says in refused.stderr.decode(), refused.stderr.decode()
    assert left_of_user(soft_daemon.data) == []


def test_the_unchanged_archive_imports_there(soft_daemon: Daemon, exported: bytes) -> None:
    """The hostile cases' base is a good archive: each refusal is its one change's."""
    done = cli("users", "import", "-", "--socket", str(soft_daemon.socket), "--json", stdin=exported)
    assert done.returncode == 0, done.stderr.decode()
    assert json.loads(done.stdout)["user"] == USER
    # Out again through the daemon (no btrfs here: the user's calls held), and the same entries.
    back = cli("users", "export", USER, "--out", "-", "--socket", str(soft_daemon.socket), "--json")
    assert back.returncode == 0, back.stderr.decode()
    assert json.loads(back.stderr)["consistentBy"] == "calls held"  # stdout is the archive
    assert [m.name for m, _ in members(back.stdout)] == [m.name for m, _ in members(exported)]


NOBODY_UID = 65534
PEER_EXPORT = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX)
sock.connect(sys.argv[1])
sock.sendall(b'{"jsonrpc":"2.0","id":1,"method":"users/export","params":{"user":"alice@example.com"}}\\n')
print(sock.makefile("rb").readline().decode())
"""


def test_another_uid_may_not_export_or_import(soft_daemon: Daemon) -> None:
    """The socket's other clients may call tools, never take a user's data: only root and the daemon's uid."""
    soft_daemon.socket.parent.chmod(0o755)
    soft_daemon.socket.chmod(0o666)
    try:
        # The system python: the venv's lies under /root, which uid 65534 cannot reach.
        ran = subprocess.run(["/usr/bin/python3", "-c", PEER_EXPORT, str(soft_daemon.socket)], capture_output=True,
                             text=True, timeout=60, preexec_fn=lambda: os.setuid(NOBODY_UID), check=False)
    finally:
        soft_daemon.socket.chmod(0o660)
        soft_daemon.socket.parent.chmod(0o700)
    answer = json.loads(ran.stdout)
    assert answer["error"]["code"] == -32003, ran.stdout + ran.stderr
    assert f"uid {NOBODY_UID} may call tools here" in answer["error"]["message"]


def test_a_raw_method_must_be_alone_on_its_connection(soft_daemon: Daemon) -> None:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(soft_daemon.socket))
        sock.sendall(b'{"jsonrpc":"2.0","id":1,"method":"ping"}\n'
                     b'{"jsonrpc":"2.0","id":2,"method":"users/export","params":{"user":"a@example.com"}}\n')
        data = b""
        while data.count(b"\n") < 2 and (chunk := sock.recv(4096)):
            data += chunk
    answers = [json.loads(line) for line in data.splitlines()]
    assert answers[0] == {"jsonrpc": "2.0", "id": 1, "result": {}}
    assert "first and only request on a connection" in answers[1]["error"]["message"]
