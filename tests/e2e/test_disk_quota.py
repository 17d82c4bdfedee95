"""A user's share of the disk (issue 35): real daemon, real Docker, filesystems made here on loop devices.

Hard mode: the data path on a small btrfs with quota on; a hostile tool fills /officer/user and
/officer/data (bytes, many small files, fallocate) and the kernel stops it at the user's quota,
while another user keeps writing; the hostile user's next calls work, and free space.
Soft mode: the data path on a small ext4 (this kernel has no ext4 quota): a user over quota is
refused the next call, and served again once their folders hold less. Each filesystem is
unmounted, its loop device detached and its image removed, whatever the test's outcome.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest

from sandboxd.client import RpcError

from tests.e2e.conftest import PYTHON_SCRIPT_TOOL, Daemon, write_tool
from tests.e2e.hostile_harness import wait_until
from tests.e2e.results import ok, refused
from tests.loopfs import MIB, loop_devices_usable, loop_filesystem

pytestmark = [pytest.mark.docker, pytest.mark.skipif(bool(loop_devices_usable("btrfs")),
                                                     reason=str(loop_devices_usable("btrfs")))]

A, B = "hostile@example.com", "bystander@example.com"


# Writes 1-MiB chunks with fsync until `mib` or an error; prints how many went in, then fails on the error.
FILL = """
import os, sys
path, mib = {path!r}, {mib}
written = 0
try:
    with open(path, 'wb') as f:
        for _ in range(mib):
            f.write(b'x' * (1 << 20)); f.flush(); os.fsync(f.fileno()); written += 1
except OSError as exc:
    print('wrote', written, 'MiB then', exc); sys.exit(1)
print('wrote', written, 'MiB')
"""

SMALL_FILES = """
import os, sys
os.makedirs({folder!r}, exist_ok=True)
made = 0
try:
    for i in range({count}):
        with open(os.path.join({folder!r}, str(i)), 'wb') as f:
            f.write(b'y' * {size})
        made += 1
    os.sync()
except OSError as exc:
    print('made', made, 'files then', exc); sys.exit(1)
print('made', made, 'files')
"""

FALLOCATE = """
import os, sys
fd = os.open({path!r}, os.O_WRONLY | os.O_CREAT, 0o600)
try:
    os.posix_fallocate(fd, 0, {size})
except OSError as exc:
    print('fallocate failed:', exc); sys.exit(1)
print('fallocated', {size})
"""


def started(make_daemon: Any, tmp_path: Path, config: str) -> Daemon:
    daemon = make_daemon(config, start=False)
    assert daemon.data == tmp_path / "d0" / "data"  # the folder the test mounted its filesystem on
    write_tool(daemon.data / "tools", "python", PYTHON_SCRIPT_TOOL, inputs="  script:\n    type: string\n    description: Python to run.\n")
    return daemon.start()


def python(daemon: Daemon, user: str, script: str) -> dict[str, Any]:
    with daemon.client() as client:
        result: dict[str, Any] = client.call_tool(user, "python", {"script": script}, timeoutMs=120_000)
        return result


def written_mib(message: str) -> int:
    return int(message.split()[1])


HARD = """
pool:
  max_per_user: 1
  min_idle: 0
storage:
  enforcement: hard
  quota_bytes: 32m
  quota_inodes: 2000
"""


def test_hard_quota_stops_a_hostile_tool_at_the_limit_and_others_keep_writing(make_daemon: Any, tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "d0" / "data", "btrfs", 512):
        daemon = started(make_daemon, tmp_path, HARD)
        try:
            assert {e["area"]: e["enforcement"] for e in daemon.events("storage_enforcement")} == \
                {"data": "hard", "email": "hard"}
            # Bytes: the write stops at the quota (a bystander writes meanwhile) and the answer says which limit.
            bystander: dict[str, Any] = {}
            writer = threading.Thread(target=lambda: bystander.update(
                python(daemon, B, FILL.format(path="/officer/user/mine", mib=16))))
            writer.start()
            full = refused(python(daemon, A, FILL.format(path="/officer/user/big", mib=64)),
                           "Disk quota exceeded", "storage.quota_bytes", "Delete files")
            writer.join(120)
            assert 24 <= written_mib(full) <= 32, full
            assert ok(bystander) == "wrote 16 MiB"  # a user's quota is theirs alone
            # The email folder shares the user's quota: full too, for writes and for fallocate.
            refused(python(daemon, A, FILL.format(path="/officer/data/mail", mib=8)), "Disk quota exceeded")
            refused(python(daemon, A, FALLOCATE.format(path="/officer/data/reserved", size=8 * MIB)), "Disk quota exceeded")
            # The sandbox still works: the user frees space and writes again.
            ok(python(daemon, A, "import os; os.remove('/officer/user/big')"))
            assert ok(python(daemon, A, FILL.format(path="/officer/data/mail", mib=8))) == "wrote 8 MiB"
            # fallocate reserves no more than the quota (1 GiB in 1 ms before this).
            refused(python(daemon, A, FALLOCATE.format(path="/officer/user/huge", size=1 << 30)), "Disk quota exceeded")
            ok(python(daemon, A, "import os; os.remove('/officer/user/huge') if os.path.exists('/officer/user/huge') else None;"
                                 "os.remove('/officer/data/mail')"))
            # Many small files: their metadata counts in the byte quota, so the kernel stops them too ...
            flood = refused(python(daemon, A, SMALL_FILES.format(folder="/officer/user/many", count=300_000, size=1500)),
                            "Disk quota exceeded")
            assert int(flood.split()[1]) < 100_000, flood
            # ... and past quota_inodes the user is still served (issue 44): their own next call cleans up.
            cleanup = "import shutil; shutil.rmtree('/officer/user/many'); print('cleaned')"
            assert ok(python(daemon, A, cleanup)) == "cleaned"
            assert ok(python(daemon, B, "print('served')")) == "served"
            assert _status(daemon)["storage"]["refusals"] == 0  # hard: the kernel stops writes, nothing refuses calls
        finally:
            daemon.stop()


def _served(daemon: Daemon, user: str) -> bool:
    try:
        return ok(python(daemon, user, "print('back')")) == "back"
    except RpcError as exc:
        if exc.code == -32004:
            return False
        raise


def _status(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as client:
        status: dict[str, Any] = client.request("sandbox/status")
        return status


SOFT = """
pool:
  max_per_user: 1
  min_idle: 0
storage:
  quota_bytes: 8m
  quota_inodes: 5000
  measure_interval_s: 2
"""


def test_soft_quota_refuses_a_user_over_it_until_they_clean_up(make_daemon: Any, tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "d0" / "data", "ext4", 96):
        daemon = started(make_daemon, tmp_path, SOFT)
        try:
            # auto on a filesystem with no quota the kernel enforces: soft, said once at start.
            assert {e["area"]: e["enforcement"] for e in daemon.events("storage_enforcement")} == \
                {"data": "soft", "email": "soft"}
            assert len(daemon.events("storage_quota_soft")) == 1
            # Soft mode cannot stop the write itself (sparse files cost nothing and count nothing) ...
            ok(python(daemon, A, "f = open('/officer/user/sparse', 'wb'); f.truncate(1 << 40)"))
            ok(python(daemon, A, FILL.format(path="/officer/data/big", mib=12)))
            # ... but the next call is refused, naming the usage, the limit and the fix.
            with pytest.raises(RpcError) as over:
                wait_until(lambda: python(daemon, A, "print('hi')") and False, 15, "a refusal over quota_bytes")
            assert over.value.code == -32004, over.value
            # The biggest entries as the sandbox sees them, and the operator's command (issue 44, item 8).
            for words in ("12.0 MiB", "8.0 MiB", "storage.quota_bytes", "Delete files", "the biggest: /officer/data/big (12.0 MiB)",
                          f"`sandboxd storage free {A} /officer/data/big`"):
                assert words in over.value.message, over.value.message
            assert ok(python(daemon, B, "print('served')")) == "served"  # other users are served
            row = _status(daemon)["storage"]["users"][A]
            assert row["over"] and row["limitBytes"] == 8 * MIB and row["bytes"] < 16 * MIB  # the sparse TiB: nothing
            (daemon.data / "email" / A / "big").unlink()  # the operator cleans up
            assert wait_until(lambda: _served(daemon, A), 30, "the user served again after cleanup")
        finally:
            daemon.stop()


def test_hard_refuses_to_start_where_the_kernel_cannot_enforce(make_daemon: Any, tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "d0" / "data", "ext4", 32):
        daemon = make_daemon("storage:\n  enforcement: hard\n", start=False)
        with pytest.raises(AssertionError, match="daemon exited with 2"):
            daemon.start()
        assert "not on a btrfs filesystem" in daemon.log() and "storage.enforcement: auto or soft" in daemon.log()
