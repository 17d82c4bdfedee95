"""The tar framing of an archive, written and read here: ustar headers with pax records for long names.

The reader knows only what the writer makes: regular files, folders, symlinks and pax
records (``path``, ``linkpath``, ``size``; the rest ignored). Everything else a tar can hold is
refused by name: hard links, devices, fifos, GNU sparse files and long names, global
records. Each header's checksum is checked, a pax record is bounded, and the end of the
stream before an entry's last byte is a truncated archive.
"""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from typing import Callable, Iterator

from sandboxd.storage.transfer.manifest import ArchiveRefused

BLOCK = 512
END = b"\0" * (2 * BLOCK)
RECORD = 20 * BLOCK  # what a tar is padded to, as tar(1) and Python's tarfile write it
MAX_PAX_BYTES = 64 << 10
_KINDS = {b"0": "file", b"\0": "file", b"5": "dir", b"2": "symlink"}
_REFUSED = {b"1": "a hard link", b"3": "a character device", b"4": "a block device", b"6": "a fifo",
            b"S": "a GNU sparse file", b"L": "a GNU long name", b"K": "a GNU long link name",
            b"g": "a global pax header", b"7": "a contiguous file", b"V": "a volume header",
            b"M": "a multi-volume part"}


@dataclass(frozen=True)
class Header:
    name: str
    kind: str  # file | dir | symlink
    mode: int
    size: int
    target: str = ""


def header(name: str, kind: str, *, mode: int, size: int = 0, target: str = "", mtime: int = 0) -> bytes:
    """The header blocks (a pax record first when a name needs it) of one entry."""
    info = tarfile.TarInfo(name)
    info.type = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE}[kind]
    info.mode, info.size, info.linkname, info.mtime = mode, size, target, mtime
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "strict")


def padding(size: int) -> bytes:
    return b"\0" * (-size % BLOCK)


class TarReader:
    """Entries from ``read(n)`` (a blocking read of at most n bytes, b"" at the end), one at a time."""

    def __init__(self, read: Callable[[int], bytes]) -> None:
        self._read = read
        self.bytes_read = 0
        self._left = 0  # of the current entry's data
        self._pad = 0
        self._current = "the archive"

    def _exactly(self, n: int, what: str) -> bytes:
        chunks, got = [], 0
        while got < n:
            chunk = self._read(n - got)
            if not chunk:
                raise ArchiveRefused(what, "the archive ends here: it is truncated")
            chunks.append(chunk)
            got += len(chunk)
        self.bytes_read += n
        return b"".join(chunks)

    def next(self) -> Header | None:
        """The next entry's header, None at the end of the archive. The previous entry's data must have been read."""
        assert self._left == 0, "the previous entry's data was not read"
        self._exactly(self._pad, self._current)
        self._pad = 0
        pax: dict[str, str] = {}
        while True:
            block = self._exactly(BLOCK, f"the header after {self._current!r}")
            if block == b"\0" * BLOCK:
                self._finish()
                return None
            name, kind, mode, size, target = _parse(block, self._current)
            self._current = pax.get("path", name)
            if kind != b"x":
                break
            if size > MAX_PAX_BYTES:
                raise ArchiveRefused(self._current, f"its pax record is {size} bytes, more than {MAX_PAX_BYTES}")
            pax = _pax_records(self._exactly(size + (-size % BLOCK), self._current)[:size], self._current)
        return self._entry(kind, mode, size, target, pax)

    def _entry(self, kind: bytes, mode: int, size: int, target: str, pax: dict[str, str]) -> Header:
        name = self._current
        if any(key.startswith("GNU.sparse") for key in pax):
            raise ArchiveRefused(name, "it is a GNU sparse file; sparse entries are never imported")
        if kind not in _KINDS:
            why = _REFUSED.get(kind, f"an entry of tar type {kind!r}")
            raise ArchiveRefused(name, f"it is {why}; only files, folders and symlinks are imported")
        if "size" in pax:
            if not pax["size"].isdigit():
                raise ArchiveRefused(name, "its pax size is not a number")
            size = int(pax["size"])
        if _KINDS[kind] != "file" and size:
            raise ArchiveRefused(name, f"a {_KINDS[kind]} with {size} bytes of data")
        self._left, self._pad = size, -size % BLOCK
        if _KINDS[kind] == "dir" and name.endswith("/"):  # as tar writes a folder's name
            name = self._current = name[:-1]
        return Header(name, _KINDS[kind], mode, size, pax.get("linkpath", target))

    def data(self, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The current entry's data, in chunks of at most ``chunk`` bytes."""
        while self._left:
            piece = self._exactly(min(chunk, self._left), self._current)
            self._left -= len(piece)
            yield piece

    def _finish(self) -> None:
        """After the first zero block: only zeros, up to the end of the record (the second block, the padding).

        Nothing past the record is read, so the end needs no EOF from the sender: over TLS, which has
        no half-close, the client sends the archive and waits for the answer."""
        while left := -self.bytes_read % RECORD:
            chunk = self._read(left)
            if not chunk:
                return  # a tar not padded to its record is whole all the same
            self.bytes_read += len(chunk)
            if chunk.count(0) != len(chunk):
                raise ArchiveRefused(f"the end of the archive, after {self._current!r}",
                                     "data follows the end-of-archive marker")


def _parse(block: bytes, after: str) -> tuple[str, bytes, int, int, str]:
    """(name, type flag, mode, size, link target) of a ustar header block."""
    name = _text(block[0:100])
    what = name or f"the header after {after!r}"
    if block[257:262] != b"ustar":
        raise ArchiveRefused(what, "it is not a tar header (no ustar magic): the file is not a tar archive")
    stored = _octal(block[148:156], what, "checksum")
    if stored != sum(block[:148]) + 8 * 32 + sum(block[156:]):
        raise ArchiveRefused(what, "its header checksum does not match: the archive is damaged")
    prefix = _text(block[345:500])
    if prefix:
        name = prefix + "/" + name
    return (name, block[156:157], _octal(block[100:108], name, "mode"), _octal(block[124:136], name, "size"),
            _text(block[157:257]))


def _text(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "replace")


def _octal(field: bytes, name: str, what: str) -> int:
    if field[:1] and field[0] & 0x80:
        raise ArchiveRefused(name, f"its {what} is in base-256; sandboxd writes pax records instead")
    text = field.split(b"\0", 1)[0].strip(b" ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise ArchiveRefused(name, f"its {what} field is not an octal number") from None


def _pax_records(data: bytes, name: str) -> dict[str, str]:
    """pax extended header records ("LEN KEY=VALUE\\n")."""
    records: dict[str, str] = {}
    at = 0
    while at < len(data):
        space = data.find(b" ", at)
        length = data[at:space]
        if space < 0 or not length.isdigit() or int(length) < space - at + 3 or at + int(length) > len(data):
            raise ArchiveRefused(name, "its pax record is malformed")
        key, sep, value = data[space + 1:at + int(length) - 1].partition(b"=")
        if not sep or data[at + int(length) - 1:at + int(length)] != b"\n":
            raise ArchiveRefused(name, "its pax record is malformed")
        try:
            records[key.decode("utf-8")] = value.decode("utf-8")
        except UnicodeDecodeError:
            raise ArchiveRefused(name, "its pax record is not UTF-8") from None
        at += int(length)
    return records
