"""What an archive of one user holds (``manifest.json``, its first entry), and the checks every entry passes.

The manifest is written by the exporting daemon but read by an importer that trusts nothing:
every path is relative and stays in the user's folder, every link's target too, no mode
carries setuid, setgid or sticky bits, and the sizes are what the quota is checked against
before a byte of data is read.
"""

from __future__ import annotations

import json
import posixpath
import re
from dataclasses import asdict, dataclass
from typing import Any

from sandboxd.errors import InvalidParams
from sandboxd.users import check_user

FORMAT = 1
MANIFEST_NAME = "manifest.json"
DATA_PREFIX = "data/"  # the user's folder's entries, in the tar
EMAIL_NAME = "email/emails.db"  # the email database, taken with SQLite's backup API
MAX_MANIFEST_BYTES = 64 << 20
MAX_PATH_BYTES = 4096
KINDS = ("file", "dir", "symlink")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_FIELDS = {"path", "kind", "mode", "size", "sha256", "target", "mtime", "owner"}


class ArchiveRefused(InvalidParams):
    """The archive is refused; ``entry`` names the entry at fault (or the archive itself)."""

    def __init__(self, entry: str, why: str) -> None:
        super().__init__(f"the archive is refused at {entry!r}: {why}; nothing of the user was imported",
                         {"entry": entry})
        self.entry = entry


@dataclass(frozen=True)
class Entry:
    """One entry of the user's folder: ``path`` relative to it (the email database's is EMAIL_NAME)."""

    path: str
    kind: str  # file | dir | symlink
    mode: int  # permission bits only (0o777 at most)
    size: int = 0  # a file's bytes
    sha256: str | None = None  # a file's
    target: str | None = None  # a symlink's, relative, within the user's folder
    mtime: int = 0
    owner: str = "host"  # host: the daemon's uid owns it; sandbox: the sandbox uid (files a tool wrote)

    @property
    def tar_name(self) -> str:
        return self.path if self.path == EMAIL_NAME else DATA_PREFIX + self.path


@dataclass(frozen=True)
class Manifest:
    user: str
    quota_bytes: int  # the exporting host's limits for the user
    quota_inodes: int
    entries: tuple[Entry, ...]
    email: Entry | None  # the database, path EMAIL_NAME

    def to_json(self) -> bytes:
        body = {"format": FORMAT, "user": self.user,
                "quota": {"bytes": self.quota_bytes, "inodes": self.quota_inodes},
                "entries": [_entry_json(entry) for entry in self.entries],
                "email": None if self.email is None else _entry_json(self.email)}
        return json.dumps(body, separators=(",", ":")).encode()

    @property
    def total_bytes(self) -> int:
        return sum(entry.size for entry in self.entries) + (self.email.size if self.email else 0)

    def by_tar_name(self) -> dict[str, Entry]:
        named = {entry.tar_name: entry for entry in self.entries}
        if self.email is not None:
            named[EMAIL_NAME] = self.email
        return named


def _entry_json(entry: Entry) -> dict[str, Any]:
    return {key: value for key, value in asdict(entry).items() if value is not None}


def parse_manifest(data: bytes) -> Manifest:
    """The manifest in ``data``, every entry checked; ArchiveRefused naming the first that fails."""
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise ArchiveRefused(MANIFEST_NAME, f"it is not JSON ({exc})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ArchiveRefused(MANIFEST_NAME, f"it is not a format-{FORMAT} manifest; export it again with this "
                                            "version of sandboxd")
    try:
        user = check_user(body.get("user"))
    except InvalidParams as exc:
        raise ArchiveRefused(MANIFEST_NAME, exc.message) from None
    quota = body.get("quota")
    if not isinstance(quota, dict) or not all(_count(quota.get(key)) for key in ("bytes", "inodes")):
        raise ArchiveRefused(MANIFEST_NAME, "its quota is not {\"bytes\": N, \"inodes\": N}")
    raw = body.get("entries")
    if not isinstance(raw, list):
        raise ArchiveRefused(MANIFEST_NAME, "its entries are not a list")
    entries = tuple(_check_entry(item) for item in raw)
    _check_tree(entries)
    email = None if body.get("email") is None else _check_entry(body["email"], email=True)
    return Manifest(user, quota["bytes"], quota["inodes"], entries, email)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_entry(item: Any, *, email: bool = False) -> Entry:
    path = item.get("path") if isinstance(item, dict) else None
    name = path if isinstance(path, str) else MANIFEST_NAME
    if not isinstance(item, dict) or set(item) - _FIELDS:
        raise ArchiveRefused(name, f"a manifest entry must be an object with only {sorted(_FIELDS)}")
    if email and path != EMAIL_NAME:
        raise ArchiveRefused(name, f"the email database's entry must be {EMAIL_NAME!r}")
    if not email:
        check_path(name)
    kind, mode = item.get("kind"), _check_mode(name, item.get("mode"))
    if kind not in KINDS or (email and kind != "file"):
        raise ArchiveRefused(name, f"kind {kind!r} is not one of {', '.join(KINDS)}")
    size, sha, target = item.get("size", 0), item.get("sha256"), item.get("target")
    if not _count(size) or (kind != "file" and size):
        raise ArchiveRefused(name, f"size {size!r} is not a byte count (only files have one)")
    if (kind == "file") != (isinstance(sha, str) and bool(_SHA256.fullmatch(sha))):
        raise ArchiveRefused(name, "a file needs a sha256 of 64 lower-case hex digits, and only a file has one")
    if kind == "symlink":
        check_link(name, target)
    elif target is not None:
        raise ArchiveRefused(name, "only a symlink has a target")
    owner, mtime = item.get("owner", "host"), item.get("mtime", 0)
    if owner not in ("host", "sandbox") or not _count(mtime):
        raise ArchiveRefused(name, "owner must be host or sandbox, and mtime a count of seconds")
    return Entry(str(path), kind, mode, size, sha, target, mtime, owner)


def _check_mode(name: str, mode: Any) -> int:
    if not isinstance(mode, int) or not _count(mode) or mode & ~0o7777:
        raise ArchiveRefused(name, f"mode {mode!r} is not a file mode")
    if mode & 0o7000:
        raise ArchiveRefused(name, f"mode {mode:o} has setuid, setgid or sticky bits; they are never imported")
    return mode


def check_path(path: str) -> None:
    """A path relative to the user's folder, in its plain form: no '..', no leading '/', no '.' or empty parts."""
    if not path or len(path.encode("utf-8", "surrogatepass")) > MAX_PATH_BYTES or "\0" in path:
        raise ArchiveRefused(path, "the path is empty, too long or holds a NUL")
    if path.startswith("/"):
        raise ArchiveRefused(path, "the path is absolute; only paths within the user's folder are imported")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ArchiveRefused(path, "the path has a '..', '.' or empty part; only plain paths within the user's "
                                   "folder are imported")


def check_link(path: str, target: Any) -> None:
    """A symlink's target must be relative and stay in the user's folder, from where the link is."""
    if not isinstance(target, str) or not target or "\0" in target or len(target) > MAX_PATH_BYTES:
        raise ArchiveRefused(path, "a symlink needs a target")
    if target.startswith("/"):
        raise ArchiveRefused(path, f"the symlink points to the absolute path {target!r}, out of the user's folder")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    if resolved == ".." or resolved.startswith("../"):
        raise ArchiveRefused(path, f"the symlink points to {target!r}, out of the user's folder")


def _check_tree(entries: tuple[Entry, ...]) -> None:
    """No path twice, and every entry's folder is a folder entry of its own (listed before it)."""
    folders: set[str] = {""}
    seen: set[str] = set()
    for entry in entries:
        if entry.path in seen:
            raise ArchiveRefused(entry.path, "the manifest lists it twice")
        seen.add(entry.path)
        parent = posixpath.dirname(entry.path)
        if parent not in folders:
            raise ArchiveRefused(entry.path, f"its folder {parent!r} is not a folder listed before it")
        if entry.kind == "dir":
            folders.add(entry.path)
