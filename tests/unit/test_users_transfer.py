"""users export/import without a daemon: a round trip, and every hostile archive refused by the entry at fault.

Each hostile archive is built here with Python's tarfile around a real export's manifest,
changed in one way; each refusal must name the entry and leave nothing of the user behind."""

from __future__ import annotations

import hashlib
import io
import json
import os
import sqlite3
import tarfile
from pathlib import Path
from typing import Any, Callable

import pytest
import zstandard

from sandboxd.config import Config, StorageConfig
from sandboxd.storage.transfer.export import compressed, stream, take_snapshot
from sandboxd.storage.transfer.importer import Ownership, import_user
from sandboxd.storage.transfer.manifest import ArchiveRefused
from sandboxd.storage.transfer.zstd import BoundedZstdReader

USER = "alice@example.com"
NOBODY = Ownership((os.getuid(), os.getgid()), None, False)  # gives nothing away, sets no qgroup


def config_at(root: Path, **storage: Any) -> Config:
    return Config(data_path=root, storage=StorageConfig(enforcement="soft", **storage))


def make_user(data: Path) -> None:
    folder = data / USER
    (folder / "tools" / "hello").mkdir(parents=True)
    (folder / "tools" / "hello" / "TOOL.md").write_text("---\nname: hello\n---\n")
    (folder / "notes").mkdir()
    for i in range(5):
        (folder / "notes" / f"{i}.txt").write_text(f"note {i}\n" * 100)
    os.symlink("notes/0.txt", folder / "latest")
    os.symlink("/etc/passwd", folder / "escape")  # left behind by the export, said
    (data / "email" / USER).mkdir(parents=True)
    db = sqlite3.connect(data / "email" / USER / "emails.db")
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE mail (id INTEGER PRIMARY KEY, body TEXT)")
    db.executemany("INSERT INTO mail (body) VALUES (?)", [(f"mail {i}",) for i in range(50)])
    db.commit()
    db.close()


def export_bytes(config: Config) -> bytes:
    snap = take_snapshot(config, USER, sandbox_uid=12345, freeze=False)
    try:
        return b"".join(stream(snap))
    finally:
        snap.close()


def reader(data: bytes) -> Callable[[int], bytes]:
    return io.BytesIO(data).read


@pytest.fixture
def exported(tmp_path: Path) -> bytes:
    source = tmp_path / "a"
    make_user(source)
    return export_bytes(config_at(source))


def tree(folder: Path) -> dict[str, str]:
    found = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        found[key] = (os.readlink(path) if path.is_symlink() else
                      hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir")
    return found


def left_of_user(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*") if USER in p.name or "sandboxd-import" in p.name]


def test_round_trip_keeps_every_byte_and_row(tmp_path: Path, exported: bytes) -> None:
    target = tmp_path / "b"
    done = import_user(config_at(target), reader(exported), NOBODY)
    assert (done.user, done.files) == (USER, 6)
    want = tree(tmp_path / "a" / USER)
    del want["escape"]
    assert tree(target / USER) == want
    rows = sqlite3.connect(target / "email" / USER / "emails.db").execute("SELECT count(*) FROM mail").fetchone()
    assert rows == (50,)


def test_zstd_round_trip(tmp_path: Path, exported: bytes) -> None:
    packed = b"".join(compressed(iter([exported])))
    done = import_user(config_at(tmp_path / "b"), BoundedZstdReader(io.BytesIO(packed).read, 1 << 30).read, NOBODY)
    assert done.files == 6


def test_a_user_with_data_here_is_refused(tmp_path: Path, exported: bytes) -> None:
    target = tmp_path / "b"
    (target / USER).mkdir(parents=True)
    with pytest.raises(ArchiveRefused, match=f"already has data on this host: {target / USER}"):
        import_user(config_at(target), reader(exported), NOBODY)
    assert os.listdir(target / USER) == []


def test_zstd_bomb_is_bounded(tmp_path: Path) -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    source = BoundedZstdReader(io.BytesIO(bomb).read, 1 << 20)
    with pytest.raises(ArchiveRefused, match="decompresses to more than"):
        while source.read(1 << 16):
            pass


# -- hostile archives: a real export's entries, rebuilt with tarfile, one thing changed ---------------------------


def members(data: bytes) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]  # type: ignore[union-attr]


def rebuild(items: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for info, body in items:
            if body is not None:
                info.size = len(body)
            tar.addfile(info, io.BytesIO(body) if body is not None else None)
    return out.getvalue()


def with_manifest(items: list[tuple[tarfile.TarInfo, bytes | None]],
                  change: Callable[[dict[str, Any]], None]) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    manifest = json.loads(items[0][1] or b"")
    change(manifest)
    return [(items[0][0], json.dumps(manifest).encode())] + items[1:]


def add_entry(entry: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda manifest: manifest["entries"].append(entry)


def member(name: str, kind: bytes = tarfile.REGTYPE, body: bytes | None = b"", **fields: Any) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in fields.items():
        setattr(info, key, value)
    return info, body if kind == tarfile.REGTYPE else None


def sha(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def file_entry(path: str, body: bytes, mode: int = 0o644) -> dict[str, Any]:
    return {"path": path, "kind": "file", "mode": mode, "size": len(body), "sha256": sha(body)}


def hostile(items: list[tuple[tarfile.TarInfo, bytes | None]], case: str) -> tuple[bytes, str]:
    """The archive of ``case`` and the entry its refusal must name."""
    end = items[-1:]
    body = b"x" * 100
    if case == "dotdot":
        return rebuild(with_manifest(items, add_entry(file_entry("../evil", body))) + [member("data/../evil", body=body)]), "../evil"
    if case == "absolute":
        return rebuild(with_manifest(items, add_entry(file_entry("/etc/evil", body))) + [member("data//etc/evil", body=body)]), "/etc/evil"
    if case == "symlink_out":
        link = {"path": "out", "kind": "symlink", "mode": 0o777, "target": "../../etc/passwd"}
        return rebuild(with_manifest(items, add_entry(link)) + [member("data/out", tarfile.SYMTYPE, linkname="../../etc/passwd")]), "out"
    if case == "symlink_absolute":
        link = {"path": "out", "kind": "symlink", "mode": 0o777, "target": "/etc/passwd"}
        return rebuild(with_manifest(items, add_entry(link)) + [member("data/out", tarfile.SYMTYPE, linkname="/etc/passwd")]), "out"
    if case == "hardlink":
        return rebuild(items + [member("data/hard", tarfile.LNKTYPE, linkname="data/latest")]), "data/hard"
    if case == "chardev":
        return rebuild(items + [member("data/null", tarfile.CHRTYPE, devmajor=1, devminor=3)]), "data/null"
    if case == "blockdev":
        return rebuild(items + [member("data/sda", tarfile.BLKTYPE, devmajor=8, devminor=0)]), "data/sda"
    if case == "fifo":
        return rebuild(items + [member("data/pipe", tarfile.FIFOTYPE)]), "data/pipe"
    if case == "setuid":
        return rebuild(with_manifest(items, add_entry(file_entry("suid", body, 0o4755))) + [member("data/suid", body=body, mode=0o4755)]), "suid"
    if case == "setgid_dir":
        folder = {"path": "shared", "kind": "dir", "mode": 0o2775}
        return rebuild(with_manifest(items, add_entry(folder)) + [member("data/shared", tarfile.DIRTYPE, mode=0o2775)]), "shared"
    if case == "sticky":
        folder = {"path": "tmp", "kind": "dir", "mode": 0o1777}
        return rebuild(with_manifest(items, add_entry(folder)) + [member("data/tmp", tarfile.DIRTYPE, mode=0o1777)]), "tmp"
    if case == "flipped_byte":
        name, data = next((i, b or b"") for i, b in items if i.name.startswith("data/notes/") and b)
        flipped = bytes([data[0] ^ 1]) + data[1:]
        return rebuild([(i, flipped if i.name == name.name else b) for i, b in items]), name.name[5:]
    if case == "size_disagrees":
        info = next(i for i, _b in items if i.name == "data/notes/1.txt")
        return rebuild([(i, (b or b"") + b"more" if i is info else b) for i, b in items]), "data/notes/1.txt"
    if case == "not_in_manifest":
        return rebuild(items + [member("data/stowaway", body=body)]), "data/stowaway"
    if case == "duplicate":
        again = next((i, b) for i, b in items if i.name == "data/notes/2.txt")
        return rebuild(items + [again]), "data/notes/2.txt"
    if case == "duplicate_in_manifest":
        return rebuild(with_manifest(items, lambda m: m["entries"].append(m["entries"][-1]))), "tools/hello/TOOL.md"
    if case == "gnu_sparse":
        return rebuild(items + [member("data/sparse", tarfile.GNUTYPE_SPARSE)], tarfile.GNU_FORMAT), "data/sparse"
    if case == "pax_sparse":
        sparse, sparse_body = member("data/sparse", body=body)
        sparse.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.realsize": str(1 << 40)}
        return rebuild(items + [(sparse, sparse_body)]), "data/sparse"
    if case == "huge_declared":
        huge = file_entry("huge", b"")
        huge.update(size=1 << 50)
        return rebuild(with_manifest(items, add_entry(huge))), "data/huge"
    if case == "over_quota":
        big = b"y" * (3 << 20)
        return rebuild(with_manifest(items, add_entry(file_entry("big", big))) + [member("data/big", body=big)]), "data/big"
    if case == "missing_entry":
        return rebuild([item for item in items if item[0].name != "data/notes/3.txt"]), "data/notes/3.txt"
    if case == "bad_database":
        junk = b"SQLite format 3\0" + b"\xff" * 4080
        return rebuild(with_manifest(items, lambda m: m["email"].update(size=len(junk), sha256=sha(junk)))
                       [:-1] + [member("email/emails.db", body=junk)]), "email/emails.db"
    del end
    raise AssertionError(case)


CASES = ["dotdot", "absolute", "symlink_out", "symlink_absolute", "hardlink", "chardev", "blockdev", "fifo", "setuid",
         "setgid_dir", "sticky", "flipped_byte", "size_disagrees", "not_in_manifest", "duplicate",
         "duplicate_in_manifest", "gnu_sparse", "pax_sparse", "huge_declared", "over_quota", "missing_entry",
         "bad_database"]


@pytest.mark.parametrize("case", CASES)
def test_hostile_archive_is_refused_by_name_and_leaves_nothing(tmp_path: Path, exported: bytes, case: str) -> None:
    archive, entry = hostile(members(exported), case)
    target = tmp_path / "b"
    with pytest.raises(ArchiveRefused) as refused:
        import_user(config_at(target, quota_bytes="2m"), reader(archive), NOBODY)
    assert refused.value.entry == entry, refused.value.message
    assert repr(entry) in refused.value.message
    assert left_of_user(target) == []


@pytest.mark.parametrize("cut", ["in a header", "in the manifest", "in a file", "in the database"])
def test_truncated_archive_is_refused(tmp_path: Path, exported: bytes, cut: str) -> None:
    at = {"in a header": 100, "in the manifest": 700, "in a file": exported.index(b"note 3") + 10,
          "in the database": exported.index(b"SQLite format 3") + 2000}[cut]
    target = tmp_path / "b"
    with pytest.raises(ArchiveRefused, match="truncated"):
        import_user(config_at(target), reader(exported[:at]), NOBODY)
    assert left_of_user(target) == []


@pytest.mark.parametrize("junk", [b"", b"not a tar at all" * 100, os.urandom(4096)])
def test_what_is_not_a_tar_is_refused(tmp_path: Path, junk: bytes) -> None:
    with pytest.raises(ArchiveRefused):
        import_user(config_at(tmp_path / "b"), reader(junk), NOBODY)
    assert left_of_user(tmp_path / "b") == []


def test_the_import_ends_at_the_archives_end_without_waiting_for_eof(tmp_path: Path, exported: bytes) -> None:
    """Over TLS there is no half-close: the import must answer once the archive's own end is read."""
    source = io.BytesIO(exported + b"never read")

    def read(n: int) -> bytes:
        assert source.tell() < len(exported), "read past the archive's end, as if waiting for EOF"
        return source.read(min(n, len(exported) - source.tell()))

    assert import_user(config_at(tmp_path / "b"), read, NOBODY).files == 6
