"""What moving one user costs (docs/performance.md): `users export` on one btrfs filesystem, `users import` on another.

A user of ``mib`` MiB (16 files of random bytes, 1,000 small files, an email database) under a
hard quota on a loop device of their own; the archive streamed from the export straight into the
import through a pipe, as a move does. Also measured: the read-only snapshot's ioctl (what
makes an export consistent without holding anyone), and the time an export that holds the
user's calls instead takes, which is what a held call would wait at most.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, Callable

from sandboxd.config import Config, StorageConfig
from sandboxd.storage import btrfs
from sandboxd.storage.provision import provision_user
from sandboxd.storage.transfer.export import stream, take_snapshot
from sandboxd.storage.transfer.importer import Ownership, import_user
from tests.loopfs import MIB, loop_devices_usable, loop_filesystem

USER = "moved@bench.example"


def transfer_cost(root: Path, *, mib: int, say: Callable[[str], None]) -> dict[str, Any]:
    problem = loop_devices_usable("btrfs")
    if problem is not None:
        return {"skipped": problem}
    size = mib * 2 + 768
    with loop_filesystem(root / "a", "btrfs", size) as a, loop_filesystem(root / "b", "btrfs", size) as b:
        source, target = _config(a, mib), _config(b, mib)
        say(f"users export/import: writing a {mib}-MiB user")
        files = _make_user(source, mib)
        os.sync()
        out: dict[str, Any] = {"mib": mib, "files": files}
        out["snapshot_ms"] = _snapshot_ms(source) * 1000
        say("users export/import: the export as a held user's calls would wait for it (no snapshot)")
        started = time.monotonic()
        snap = take_snapshot(source, USER, sandbox_uid=0, freeze=False)
        written = sum(len(chunk) for chunk in stream(snap))
        snap.close()
        out["held_s"] = time.monotonic() - started
        say("users export/import: snapshot, stream and import into the other filesystem")
        out["move_s"], out["import"] = _export_into_import(source, target)
        out["archive_bytes"] = written
    return out


def _config(data: Path, mib: int) -> Config:
    return Config(data_path=data, storage=StorageConfig(enforcement="hard", quota_bytes=f"{mib * 2}m"))


def _make_user(config: Config, mib: int) -> int:
    (config.data_path / "email").mkdir()
    provision_user(config, USER, (os.getuid(), os.getgid()))
    return make_files(config.data_path, USER, mib)


def make_files(data_path: Path, user: str, mib: int) -> int:
    """The user's files in their folder (made already) and their email database: how many files."""
    folder = data_path / user
    for i in range(16):
        with open(folder / f"blob{i:02}", "wb") as blob:
            for _ in range(mib // 16):
                blob.write(os.urandom(MIB))
    (folder / "small").mkdir()
    for i in range(1000):
        (folder / "small" / f"{i}.txt").write_bytes(os.urandom(200))
    db = sqlite3.connect(data_path / "email" / user / "emails.db")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE mail (id INTEGER PRIMARY KEY, body BLOB)")
    db.executemany("INSERT INTO mail (body) VALUES (?)", [(os.urandom(2000),) for _ in range(5000)])
    db.commit()
    db.close()
    return 16 + 1000


def _snapshot_ms(config: Config) -> float:
    """The read-only snapshot's ioctl alone, median of 5 (each removed after)."""
    times = []
    root = os.open(config.data_path, os.O_RDONLY | os.O_DIRECTORY)
    folder = os.open(config.data_path / USER, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for i in range(5):
            started = time.monotonic()
            btrfs.snapshot(root, folder, f"snap{i}")
            times.append(time.monotonic() - started)
            btrfs.delete_subvolume(root, f"snap{i}")
    finally:
        os.close(folder)
        os.close(root)
    return sorted(times)[2]


def _export_into_import(source: Config, target: Config) -> tuple[float, dict[str, Any]]:
    """Seconds from the snapshot to the user in place on ``target``, through a pipe; the import's summary."""
    read_end, write_end = os.pipe()
    started = time.monotonic()
    snap = take_snapshot(source, USER, sandbox_uid=0, freeze=True)
    assert snap.frozen

    def export() -> None:
        with os.fdopen(write_end, "wb") as pipe:
            for chunk in stream(snap):
                pipe.write(chunk)

    writer = threading.Thread(target=export)
    writer.start()
    with os.fdopen(read_end, "rb") as pipe:
        done = import_user(target, pipe.read, Ownership.of(target))
    writer.join()
    snap.close()
    return time.monotonic() - started, done.summary()


if __name__ == "__main__":
    import json
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as tmp:
        print(json.dumps(transfer_cost(Path(tmp), mib=int(sys.argv[1]) if len(sys.argv) > 1 else 1024,
                                       say=lambda text: print(text, file=sys.stderr)), indent=2))
