"""A hard quota that cannot be lost, and a user over it who can always get back under (issue 44, items 1 and 8).

Real daemon, real Docker, the data path on a btrfs loop filesystem with quota on. Item 1: every
way a user's folder can come to exist before their first sandbox (an operator's ``mkdir``, a tool
installed by copying it into ``DATA_PATH/<user>/tools/``, ``sandboxd run --user``, the first call)
ends as a quota subvolume, and a hostile tool's 200-MiB write stops at the 64-MiB quota. Item 8:
a user whose tool made more files than ``quota_inodes`` is still served, so their own cleanup
call deletes them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandboxd.storage import btrfs

from tests.e2e.conftest import PYTHON_SCRIPT_TOOL, Daemon, write_tool
from tests.e2e.hostile_harness import wait_until
from tests.e2e.results import ok
from tests.loopfs import MIB, loop_devices_usable, loop_filesystem

pytestmark = [pytest.mark.docker, pytest.mark.skipif(bool(loop_devices_usable("btrfs")),
                                                     reason=str(loop_devices_usable("btrfs")))]

QUOTA_MIB = 64
HARD = f"""
pool:
  max_per_user: 1
  min_idle: 0
storage:
  enforcement: hard
  quota_bytes: {QUOTA_MIB}m
  quota_inodes: 2000
"""

# Writes `mib` 1-MiB chunks, each led by its own byte (checksums tell them apart), fsynced, until an error (libuv has no name for EDQUOT).
FILL = """
import { closeSync, fsyncSync, openSync, writeSync } from 'node:fs';
export async function execute(_id: string, params: { file: string; mib: number }) {
  const chunk = Buffer.alloc(1 << 20, 97);
  let written = 0;
  let fd = -1;
  try {
    fd = openSync(`/officer/user/${params.file}`, 'w');
    for (; written < params.mib; written++) { chunk[0] = written & 255; writeSync(fd, chunk); fsyncSync(fd); }
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).errno === -122 ? 'EDQUOT' : (e as NodeJS.ErrnoException).code;
    return { content: [{ type: 'text', text: `wrote ${written} MiB then ${code}` }], isError: true };
  } finally { if (fd >= 0) closeSync(fd); }
  return { content: [{ type: 'text', text: `wrote ${written} MiB` }] };
}
"""
FILL_INPUTS = ("  file:\n    type: string\n    description: A file name.\n"
               "  mib:\n    type: number\n    description: MiB to write.\n")

def _written(message: str) -> int:
    assert message.startswith("wrote "), message
    return int(message.split()[1])


def _call(daemon: Daemon, user: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    with daemon.client() as client:
        result: dict[str, Any] = client.call_tool(user, tool, arguments, timeoutMs=120_000)
        return result


def _status(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as client:
        status: dict[str, Any] = client.request("sandbox/status")
        return status["storage"]


def _is_subvolume(folder: Path) -> bool:
    return os.lstat(folder).st_ino == btrfs.SUBVOLUME_ROOT_INO


def _run_cli(daemon: Daemon, tool: Path, user: str) -> str:
    """`sandboxd run TOOL --user U` with the daemon's configuration, as an operator (root) would run it."""
    env = {**daemon.env, "SANDBOXD_SANDBOX_NETWORK": "none"}
    ran = subprocess.run([sys.executable, "-m", "sandboxd", "run", str(tool), "--user", user, "--config",
                          str(daemon.config_path), "--data-path", str(daemon.data), "--arg", "file=big",
                          "--arg", "mib=200", "--backend", "docker"],
                         env=env, capture_output=True, text=True, timeout=300, check=False)
    found = [line for line in (ran.stdout + ran.stderr).splitlines() if "wrote " in line]
    assert found, f"exit {ran.returncode}\n{ran.stdout}\n{ran.stderr}"
    return found[0][found[0].index("wrote "):]


MADE, COPIED, RUN, FIRST = "made@example.com", "copied@example.com", "run@example.com", "first@example.com"


def test_every_way_a_users_folder_is_made_ends_under_the_hard_quota(make_daemon: Any, tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "d0" / "data", "btrfs", 1024):
        daemon = make_daemon(HARD, start=False)
        write_tool(daemon.data / "tools", "fill", FILL, inputs=FILL_INPUTS)
        # The operator makes a user's folder by hand, with a file in it, before any call ...
        (daemon.data / MADE).mkdir(mode=0o700)
        (daemon.data / MADE / "notes.txt").write_text("kept through the conversion")
        # ... installs a tool for another by copying it, as `sandboxd run`'s hint says ...
        mine = write_tool(tmp_path / "work", "my_fill", FILL, inputs=FILL_INPUTS)
        shutil.copytree(mine, daemon.data / COPIED / "tools" / "my_fill")
        # ... and tries a tool with a user's folder, the daemon not running yet.
        written = {"run --user": _run_cli(daemon, mine, RUN)}
        daemon.start()
        try:
            for user, tool in ((MADE, "fill"), (COPIED, "my_fill"), (FIRST, "fill"), (RUN, "fill")):
                written[user] = _message(_call(daemon, user, tool, {"file": "more", "mib": 200}))
            # Every path, each the hostile tool's 200-MiB write: stopped by the kernel at the quota.
            over = {path: message for path, message in written.items()
                    if "EDQUOT" not in message or _written(message) > QUOTA_MIB}
            unlimited = [user for user in (MADE, COPIED, FIRST, RUN) if not _is_subvolume(daemon.data / user)]
            assert not over and not unlimited, f"past the quota: {over}; plain folders: {unlimited}"
            assert (daemon.data / MADE / "notes.txt").read_text() == "kept through the conversion"
            os.sync()
            for user in (MADE, COPIED, FIRST, RUN):
                held, limit = _qgroup(daemon.data / user)
                assert limit == QUOTA_MIB * MIB and held <= QUOTA_MIB * MIB, (user, held, limit)
            assert not daemon.events("storage_folder_not_limited")
            assert {e["folder"] for e in daemon.events("storage_folder_converted")} == {MADE, COPIED}
        finally:
            daemon.stop()


def _message(result: dict[str, Any]) -> str:
    return "\n".join(c["text"] for c in result["content"])


def _qgroup(folder: Path) -> tuple[int, int]:
    """(bytes held, limit) of the qgroup that limits the user's folder, as the kernel counts them."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fs_id, subvolume = btrfs.filesystem_id(fd), btrfs.subvolume_id(fd)
    finally:
        os.close(fd)
    assert fs_id is not None
    usage = btrfs.qgroup_usage(fs_id, btrfs.qgroup_id(1, subvolume))
    assert usage is not None, f"{folder} has no qgroup of its own"
    return usage


MANY = """
import os
os.makedirs('/officer/user/many', exist_ok=True)
made = 0
try:
    for i in range({count}):
        open(f'/officer/user/many/{{i}}', 'wb').close()
        made += 1
except OSError as exc:
    print('made', made, 'then', exc)
else:
    print('made', made)
"""


def test_a_hard_quota_user_past_quota_inodes_is_served_and_deletes_their_files(make_daemon: Any, tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "d0" / "data", "btrfs", 512):
        daemon = make_daemon(HARD + "  measure_interval_s: 2\n", start=False)
        write_tool(daemon.data / "tools", "python", PYTHON_SCRIPT_TOOL,
                   inputs="  script:\n    type: string\n    description: Python to run.\n")
        daemon.start()
        try:
            user = "many@example.com"
            made = ok(_call(daemon, user, "python", {"script": MANY.format(count=5000)}))
            assert made == "made 5000", made  # within the byte quota: files are metadata bytes in it
            # Measured past quota_inodes (2000): what used to refuse every call, the cleanup included.
            over = wait_until(lambda: _inodes(daemon, user) > 2000 or None, 30, "the user measured past quota_inodes")
            assert over
            cleaned = ok(_call(daemon, user, "python", {"script": "import shutil; shutil.rmtree('/officer/user/many');"
                                                                  "print('cleaned')"}))
            assert cleaned == "cleaned"
            assert wait_until(lambda: _inodes(daemon, user) < 2000 or None, 30, "the user measured under again")
            assert _status(daemon)["refusals"] == 0
        finally:
            daemon.stop()


def _inodes(daemon: Daemon, user: str) -> int:
    row = _status(daemon)["users"].get(user)
    return int(row["inodes"]) if row else 0


def test_a_conversion_longer_than_a_sandbox_start_fails_that_call_and_a_later_one_is_served(
        make_daemon: Any, tmp_path: Path) -> None:
    """The copy runs on after the start timed out; the next start waits for it, then mounts the subvolume."""
    with loop_filesystem(tmp_path / "d0" / "data", "btrfs", 1536):
        daemon = make_daemon("pool:\n  max_per_user: 1\n  min_idle: 0\n  start_timeout_ms: 1000\n"
                             "storage:\n  enforcement: hard\n  quota_bytes: 1g\n", start=False)
        write_tool(daemon.data / "tools", "fill", FILL, inputs=FILL_INPUTS)
        big = daemon.data / MADE
        big.mkdir(mode=0o700)
        with open(big / "blob", "wb") as blob:
            for _ in range(400):
                blob.write(os.urandom(MIB))
        # Thousands of files too: the copy's time is per file as well, so a fast disk cannot finish it within 1 s.
        for folder in range(30):
            (big / f"many{folder}").mkdir()
            for index in range(1000):
                (big / f"many{folder}" / str(index)).write_bytes(b"x" * 100)
        os.sync()
        daemon.start()
        try:
            first: dict[str, Any] | Exception
            try:
                first = _call(daemon, MADE, "fill", {"file": "f", "mib": 1})
            except Exception as exc:  # the start timed out while the copy ran
                first = exc
            served = wait_until(lambda: _served(daemon), 120, "a call served once the copy ended")
            assert isinstance(first, Exception) and "did not start within" in str(first), \
                f"the premise: a copy longer than the start's 1 s ({first})"
            assert served == "wrote 1 MiB", served
            assert _is_subvolume(big) and os.path.getsize(big / "blob") == 400 * MIB
            assert len(os.listdir(big / "many29")) == 1000
        finally:
            daemon.stop()


def _served(daemon: Daemon) -> str | None:
    try:
        result = _call(daemon, MADE, "fill", {"file": "f", "mib": 1})
    except Exception:
        return None
    return _message(result) if not result["isError"] else None
