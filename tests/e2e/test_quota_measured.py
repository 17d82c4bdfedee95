"""Soft (measured) disk quota under attack (issue 44, items 6 and 7): real daemon, real Docker.

A tool failing with ENOSPC from four sandboxes at once costs the daemon one walk of the
user's folders a second, not one per failed call. A sandbox that keeps writing after its
answer (a timer), or during a long call, is destroyed within seconds of its user crossing
the quota: the bytes written stay within twice the quota, and stop.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from sandboxd.client import RpcError

from tests.e2e.conftest import PYTHON_SCRIPT_TOOL, Daemon, write_tool
from tests.e2e.hostile_harness import call, install_hostile_tools, wait_until
from tests.loopfs import loop_devices_usable, loop_filesystem

pytestmark = pytest.mark.docker

MIB = 1 << 20
A, B = "writer@example.com", "bystander@example.com"


def _started(make_daemon: Any, config: str) -> Daemon:
    daemon = make_daemon(config, start=False)
    install_hostile_tools(daemon)
    write_tool(daemon.data / "tools", "python", PYTHON_SCRIPT_TOOL, inputs="  script:\n    type: string\n    description: Python to run.\n")
    return daemon.start()


def _status(daemon: Daemon) -> dict[str, Any]:
    with daemon.client() as client:
        status: dict[str, Any] = client.request("sandbox/status")
        return status


FLOOD = """
pool:
  max_per_user: 4
  min_idle: 0
storage:
  enforcement: soft
  measure_interval_s: 600
"""


def test_enospc_failures_from_four_sandboxes_cost_one_walk_a_second(make_daemon: Any) -> None:
    daemon = _started(make_daemon, FLOOD)
    folder = daemon.user_dir(A)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(2000):  # something to walk: each walk costs what the user holds
        (folder / f"f{i}").write_bytes(b"x")
    failed, walks, seconds, cores = _enospc_flood(daemon, 8)
    assert failed >= 2 * (seconds + 2), failed  # more failed calls than walks allowed, twice over at least
    # One user: at most one walk a second (and the first at once), whatever the number of failed calls.
    assert walks <= seconds + 2, f"{walks} walks in {seconds:.1f} s for {failed} failed calls"
    print(f"soft: {walks} walks in {seconds:.1f} s for {failed} failed calls, the daemon at {cores:.2f} core")


HARD = """
pool:
  max_per_user: 4
  min_idle: 0
storage:
  enforcement: hard
  quota_bytes: 64m
  measure_interval_s: 600
"""


@pytest.mark.skipif(bool(loop_devices_usable("btrfs")), reason=str(loop_devices_usable("btrfs")))
def test_in_hard_mode_failed_calls_walk_nothing(make_daemon: Any, tmp_path: Path) -> None:
    with loop_filesystem(tmp_path / "d0" / "data", "btrfs", 512):
        daemon = _started(make_daemon, HARD)
        try:
            assert daemon.data == tmp_path / "d0" / "data"
            failed, walks, seconds, cores = _enospc_flood(daemon, 4)
            assert failed > 0 and walks == 0, (failed, walks)  # the kernel holds the bytes: nothing to walk
            print(f"hard: {walks} walks in {seconds:.1f} s for {failed} failed calls, the daemon at {cores:.2f} core")
        finally:
            daemon.stop()


def _enospc_flood(daemon: Daemon, seconds: float) -> tuple[int, int, float, float]:
    """Four clients call disk_full_liar as A in a loop from four sandboxes for ``seconds``: (failed calls,
    walks meanwhile, seconds, the daemon's CPU in cores)."""
    failed = [0] * 4

    def flood(index: int, until: float) -> None:
        with daemon.client() as client:
            while time.monotonic() < until:
                result = call(client, A, "disk_full_liar")
                assert result["isError"] and "ENOSPC" in str(result["content"]), result
                failed[index] += 1

    _flood_from_four(flood, 1)  # four warm sandboxes: the flood is calls, not starts
    failed[:] = [0] * 4
    before, cpu = _status(daemon)["storage"]["walks"], _cpu_s(daemon)
    started = time.monotonic()
    _flood_from_four(flood, seconds)
    took = time.monotonic() - started
    return sum(failed), _status(daemon)["storage"]["walks"] - before, took, (_cpu_s(daemon) - cpu) / took


def _cpu_s(daemon: Daemon) -> float:
    assert daemon.proc is not None
    fields = Path(f"/proc/{daemon.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _flood_from_four(flood: Any, seconds: float) -> None:
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=flood, args=(i, until)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)


WRITER = """
pool:
  max_per_user: 2
  min_idle: 0
storage:
  enforcement: soft
  quota_bytes: 48m
  quota_inodes: 5000
  measure_interval_s: 600
"""
QUOTA = 48 * MIB


# 30 folders of 200-character names (a path of ~6,000 characters, past PATH_MAX), 64 MiB at the bottom.
DEEP = """
import os
fd = os.open('/officer/user', os.O_RDONLY | os.O_DIRECTORY)
for _ in range(30):
    os.mkdir('d' * 200, dir_fd=fd)
    below = os.open('d' * 200, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
    os.close(fd)
    fd = below
big = os.open('big', os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
for _ in range(64):
    os.write(big, b'x' * (1 << 20))
os.fsync(big)
print('hidden')
"""


def test_files_past_path_max_count_against_the_soft_quota(make_daemon: Any) -> None:
    daemon = _started(make_daemon, WRITER)
    with daemon.client() as client:
        assert call(client, A, "python", {"script": DEEP})["isError"] is False
    # Counted, so the user is over quota and refused (before: 64 MiB counted as nothing, served on).
    with pytest.raises(RpcError) as over:
        wait_until(lambda: _call_python(daemon, A) and False, 15, "a refusal over quota_bytes")
    assert over.value.code == -32004 and "storage.quota_bytes" in over.value.message, over.value
    row = _status(daemon)["storage"]["users"][A]
    assert row["over"] and row["bytes"] >= 64 * MIB and row["inodes"] >= 31, row


def _call_python(daemon: Daemon, user: str) -> dict[str, Any]:
    with daemon.client() as client:
        return call(client, user, "python", {"script": "print('hi')"})


def _held(folder: Path) -> int:
    """Blocks under ``folder``, as the host sees them."""
    total = 0
    for root, _dirs, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def test_soft_quota_destroys_every_sandbox_of_a_user_over_it_so_no_writer_survives(make_daemon: Any) -> None:
    daemon = _started(make_daemon, WRITER)
    busy: dict[str, Any] = {}

    def busy_call() -> None:  # writes during its own call, for up to 50 s
        with daemon.client() as client:
            busy.update(call(client, A, "late_writer", {"path": "/officer/user/busy", "everyMs": 250, "holdMs": 50_000},
                             timeoutMs=90_000), ended=time.monotonic())

    writer = threading.Thread(target=busy_call)
    writer.start()
    time.sleep(0.5)
    with daemon.client() as client:
        # Another sandbox answers at once, and its timer keeps writing: 8 MiB/s in all, past 48 MiB in ~6 s.
        late = call(client, A, "late_writer", {"path": "/officer/user/late", "everyMs": 250, "holdMs": 0})
        assert late["isError"] is False, late
        assert call(client, B, "late_writer", {"path": "/officer/user/small", "everyMs": 1000, "holdMs": 1})["isError"] is False
    # Within a MiB of it (writes are whole MiBs): the daemon's count adds the folders' own blocks, so it may
    # stop them before their files alone pass the quota.
    crossed = wait_until(lambda: _held(daemon.user_dir(A)) >= QUOTA - MIB and time.monotonic(), 40,
                         "the writers at the quota")
    # The busy call is ended and both sandboxes destroyed within seconds, not at idle_ttl_s.
    writer.join(20)
    assert not writer.is_alive(), "the writing call was not stopped"
    stopped = busy["ended"] - crossed  # below 0: stopped before this test's own look saw the crossing
    assert busy["isError"] and "disk quota" in str(busy["content"]), busy
    events = daemon.events("storage_over_quota_stopped", user=A)
    assert events and len(events[0]["sandboxes"]) == 2, events
    wait_until(lambda: _sandboxes(daemon, A) == 0, 15, "the user's sandboxes gone")
    # Nothing writes any more, and what was written stays within twice the quota.
    first = _held(daemon.user_dir(A))
    time.sleep(3)
    last = _held(daemon.user_dir(A))
    assert last == first, f"still writing: {first} then {last} bytes"
    assert last < 2 * QUOTA, f"{last / MIB:.0f} MiB written against a {QUOTA / MIB:.0f}-MiB quota"
    with daemon.client() as client:  # refused while over; a bystander is served
        with pytest.raises(Exception, match="storage.quota_bytes"):
            call(client, A, "late_writer", {"path": "/officer/user/more", "everyMs": 250, "holdMs": 1})
        assert call(client, B, "disk_full_liar")["isError"]  # served (its tool fails, as it always does)
    print(f"the writing call ended {stopped:+.1f} s from the crossing seen here; "
          f"{last / MIB:.1f} MiB held against a {QUOTA / MIB:.0f}-MiB quota")


def _sandboxes(daemon: Daemon, user: str) -> int:
    row = _status(daemon)["pool"]["users"].get(user)
    return 0 if row is None else int(row["idle"] + row["busy"] + row["starting"] + row["stopping"])
