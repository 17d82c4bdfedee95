"""The usage walk sees everything (storage/usage.py), and walks are coalesced (storage/walks.py), without Docker.

A tree deeper than PATH_MAX is counted in full with a bounded number of descriptors; a folder
the daemon cannot read (chmod 000, as an unprivileged uid) makes the user over quota, never
zero; many failed calls at once share one walk a second.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import pytest

from sandboxd.config import load_config
from sandboxd.storage.quota import Storage
from sandboxd.storage.usage import MAX_OPEN_DIRS, Usage, _Walk, measure

MIB = 1 << 20
NOBODY = 65534


def _deep_tree(root: Path, depth: int) -> tuple[int, int]:
    """A chain of ``depth`` folders with 200-character names (past PATH_MAX from depth 21), each with a
    sibling folder holding a file, and a 1-MiB file and 200 small ones at the bottom; (entries, bytes at least)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    entries = 1  # root
    try:
        for level in range(depth):
            os.mkdir("s", dir_fd=fd)  # a sibling: walked after the chain below, through reopened parents
            side = os.open("s", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=side))
            os.close(side)
            name = f"{level:03d}" + "d" * 197
            os.mkdir(name, dir_fd=fd)
            below = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
            entries += 3
        big = os.open("big", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
        os.write(big, b"x" * MIB)
        os.close(big)
        for i in range(200):
            os.close(os.open(str(i), os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
        entries += 201
    finally:
        os.close(fd)
    os.sync()
    return entries, MIB


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_tree_past_path_max_is_counted_in_full_with_bounded_descriptors(tmp_path: Path) -> None:
    depth = 3 * MAX_OPEN_DIRS  # 96 levels of 200 characters: a path of ~19,000, past PATH_MAX (4096)
    entries, least = _deep_tree(tmp_path, depth)
    before = _open_fds()
    walk = _Walk(1_000_000)
    walk.folder(tmp_path)
    usage = walk.usage()
    assert usage == Usage(usage.bytes, entries, True, None), usage  # every entry, nothing unreadable
    assert usage.bytes >= least
    assert walk.most_open == MAX_OPEN_DIRS  # the walk's descriptors, whatever the depth
    assert _open_fds() == before  # all closed
    # measure() itself: the same figures, and its bound still stops it.
    assert measure([tmp_path], 1_000_000) == usage
    assert measure([tmp_path], 50) == Usage(measure([tmp_path], 50).bytes, 51, False, None)


def _as_nobody(folder: Path, body: Callable[[Path], object]) -> object:
    """``body(folder)`` as an unprivileged uid (forked, setuid as root; in-process otherwise)."""
    if os.geteuid() != 0:
        return body(folder)
    os.chown(folder, NOBODY, NOBODY)
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write_end, pickle.dumps(body(folder)))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            os.write(write_end, pickle.dumps(AssertionError(f"child: {exc!r}")))
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    data = b""
    while chunk := os.read(read_end, 1 << 16):
        data += chunk
    os.close(read_end)
    os.waitpid(pid, 0)
    result = pickle.loads(data)
    if isinstance(result, AssertionError):
        raise result
    return result


def _hide_and_measure(mode: int) -> Callable[[Path], object]:
    """A user's folder with 3 MiB under a subfolder made unreadable (``mode``); measured by a soft-mode Storage:
    (the usage, whether it is over its 1-GiB quota, the refusal's message)."""
    def body(data: Path) -> object:
        user = "x@example.com"
        hidden = data / user / "hidden"
        (hidden / "deeper").mkdir(parents=True)
        (hidden / "deeper" / "big").write_bytes(b"h" * 3 * MIB)
        os.sync()
        store = Storage(load_config(environ={}, overrides={"data_path": data, "storage": {"quota_bytes": "1g"}}))
        store.resolve()  # soft: /tmp is no btrfs with quota
        hidden.chmod(mode)
        try:
            record = store.measure_now(user)
            refusal = store.refusal(user)
            return record.usage, record.over_bytes, refusal.message if refusal is not None else None
        finally:
            hidden.chmod(0o700)
            store.close()
    return body


@pytest.mark.parametrize("mode", [0o000, 0o400], ids=["chmod-000", "readable-not-searchable"])
def test_a_folder_the_daemon_cannot_read_is_named_and_counts_as_over_never_as_zero(mode: int) -> None:
    data = Path(tempfile.mkdtemp(prefix="sandboxd-walk-", dir="/tmp"))
    try:
        data.chmod(0o755)
        result = _as_nobody(data, _hide_and_measure(mode))
    finally:
        shutil.rmtree(data)
    assert isinstance(result, tuple)
    usage, over, refusal = result
    assert not usage.complete and usage.bytes < MIB, usage  # the 3 MiB were not seen ...
    assert usage.unreadable is not None and "hidden" in usage.unreadable and "Permission denied" in usage.unreadable
    assert over  # ... so the user counts as over their 1-GiB quota, not as holding nothing
    assert refusal is not None and "cannot read" in refusal and "hidden" in refusal, refusal


def test_failed_calls_at_once_share_one_walk_a_second(tmp_path: Path) -> None:
    store = Storage(load_config(environ={}, overrides={"data_path": tmp_path, "storage": {"quota_bytes": "2m"}}))
    store.resolve()  # soft: tmp is no btrfs with quota
    user = "dora@example.com"
    (tmp_path / user).mkdir()
    (tmp_path / user / "f").write_bytes(b"q" * 2 * MIB)
    os.sync()

    async def flood() -> tuple[list[str | None], float]:
        started = time.monotonic()
        notes = await asyncio.gather(*(store.note(user) for _ in range(40)))  # 40 calls failed with ENOSPC at once
        for _ in range(20):  # and more after it, each a failed call's end and note
            store.after_call(user)
            await asyncio.sleep(0.05)
        notes.append(await store.note(user))
        return list(notes), time.monotonic() - started

    notes, took = asyncio.run(flood())
    assert all(note is not None and "storage.quota_bytes" in note for note in notes)  # each had a fresh answer
    assert store.status()["walks"] <= int(took) + 2, (store.status()["walks"], took)  # not 60 walks
    store.close()


def test_a_thread_behind_holds_at_most_one_walk_of_a_user() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from sandboxd.storage.walks import Walks

    executor = ThreadPoolExecutor(1)
    started: list[float] = []

    def slow_walk(user: str) -> int:  # a walk far longer than the spacing (a huge tree, a slow disk)
        started.append(time.monotonic())
        time.sleep(4.0)  # the asks below end 1.5 s before it does
        return len(started)

    walks: Walks[int] = Walks(executor, slow_walk, lambda _user, _future: None)

    async def main() -> list[int]:
        asked = []
        for _ in range(10):  # a call's end every 0.25 s while the first walk runs
            asked.append(walks.next("a@x.io"))
            await asyncio.sleep(0.25)
        return list(await asyncio.gather(*asked))

    results = asyncio.run(main())
    executor.shutdown()
    # The first walk, then one more shared by everyone who asked meanwhile: not one queued per second.
    assert results == [1] + [2] * 9 and len(started) == 2, (results, len(started))
