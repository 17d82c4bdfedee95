"""`sandboxd users export` and `sandboxd users import`: one user's data out of a daemon and into one (a backup, a restore)."""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterator, cast

from sandboxd import rawstream
from sandboxd.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, fail, user_argument
from sandboxd.client import DaemonUnreachable, RpcError
from sandboxd.config import Config

CHUNK = 1 << 20
_END = b"\0" * 1024  # a whole tar ends with two zero blocks
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_REFUSED = -32602  # the archive or the request was refused (the message says which entry and why)


def add_commands(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    users = _users_group(subparsers)
    export = users.add_parser(
        "export", parents=[parent], help="write one user's files, tools and email database as an archive",
        description="Ask the daemon that holds USER for their archive: a tar (FILE.tar) or a zstd-compressed one "
                    "(FILE.tar.zst), manifest.json first, every file's sha256 in it. Consistent: a read-only btrfs "
                    "snapshot, or the user's calls held while it is written. Run it as root or as the daemon's "
                    "user. Exit status: 0 written, 2 usage or daemon error.")
    export.add_argument("user", type=user_argument, metavar="USER", help="the user (an email address)")
    export.add_argument("--out", required=True, metavar="FILE", help="where to write it: FILE.tar, FILE.tar.zst, or - "
                        "for stdout (add --zstd to compress)")
    export.add_argument("--zstd", action="store_true", help="compress (implied by an --out ending in .zst)")
    _common(export)
    export.set_defaults(handler=export_command)
    imported = users.add_parser(
        "import", parents=[parent], help="put a user's archive in place on this host",
        description="Send an archive made by `sandboxd users export` to the daemon, which checks every entry "
                    "against its manifest and the user's quota here, and puts the user in place only when all of "
                    "it holds. A user who already has data here is refused. Run it as root or as the daemon's "
                    "user. Exit status: 0 imported, 1 the archive was refused (the entry is named), 2 usage or "
                    "daemon error.")
    imported.add_argument("file", metavar="FILE", help="the archive (.tar or .tar.zst), or - for stdin")
    _common(imported)
    imported.set_defaults(handler=import_command)


def _users_group(subparsers: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The `users` command's subcommands: made here, or the ones cluster_cmds made (`users where`)."""
    users = subparsers.choices.get("users")
    if users is None:
        users = subparsers.add_parser("users", help="one user as a unit: export, import",
                                      description="One user as a unit (docs/scale.md).")
        return users.add_subparsers(dest="users_command", metavar="COMMAND", required=True)
    return next(action for action in users._actions if isinstance(action, argparse._SubParsersAction))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", type=Path, metavar="PATH", help="the daemon's socket")
    p.add_argument("--json", action="store_true", help="print {user, files, bytes, seconds} on stdout (on stderr "
                   "when stdout carries the archive)")


def _connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        sock.close()
        raise DaemonUnreachable(f"no sandboxd is listening on {path} ({exc.strerror}); start it or pass --socket.") from None
    except PermissionError:
        sock.close()
        raise DaemonUnreachable(f"permission denied on {path}; run as root or as the daemon's user.") from None
    return sock


def _say(args: argparse.Namespace, summary: dict[str, Any], verb: str) -> None:
    if args.json:  # on stderr when stdout carries the archive (--out -)
        print(json.dumps(summary), file=sys.stderr if getattr(args, "out", None) == "-" else sys.stdout)
    else:
        print(f"{verb} {summary['user']}: {summary['files']} files, {summary['bytes']} bytes in {summary['seconds']} s",
              file=sys.stderr)


def export_command(args: argparse.Namespace, config: Config) -> int:
    started = time.monotonic()
    zstd = args.zstd or args.out.endswith(".zst")
    target = Path(args.out) if args.out != "-" else None
    partial = target.with_name(target.name + ".partial") if target is not None else None
    try:
        with _connect(config.socket) as sock:
            result, archive = rawstream.export(sock, {"user": args.user, "compress": "zstd" if zstd else None})
            out: IO[bytes] = open(partial, "wb") if partial is not None else sys.stdout.buffer
            try:
                whole = _copy(archive, out, zstd)
            finally:
                if partial is not None:
                    out.close()
    except (DaemonUnreachable, RpcError, OSError) as exc:
        if partial is not None:
            partial.unlink(missing_ok=True)
        return fail(str(exc), EXIT_USAGE)
    if not whole:
        if partial is not None:
            partial.unlink(missing_ok=True)
        return fail(f"the export of {args.user} was cut short (the daemon's log says why); nothing was kept. "
                    "Export again.", EXIT_USAGE)
    if target is not None and partial is not None:
        os.replace(partial, target)
    _say(args, {"user": result["user"], "files": result["files"], "bytes": result["bytes"],
                "seconds": round(time.monotonic() - started, 3), "consistentBy": result.get("consistentBy"),
                "skipped": result.get("skipped", [])}, "exported")
    for path in result.get("skipped", []):
        print(f"sandboxd: left out {path} (a fifo, socket or device, or a link out of the user's folder)",
              file=sys.stderr)
    return EXIT_OK


class _Tail:
    """The last bytes written to it: the tar's end marker, when the archive came whole."""

    def __init__(self) -> None:
        self.tail = b""

    def write(self, data: bytes) -> int:
        self.tail = (self.tail + bytes(data[-len(_END):]))[-len(_END):]
        return len(data)


def _copy(archive: Iterator[bytes], out: IO[bytes], zstd: bool) -> bool:
    """Write the archive out; whether it arrived whole (the tar's end marker, decompressed in pieces when zstd)."""
    import zstandard

    tail = _Tail()
    check: Any = zstandard.ZstdDecompressor().stream_writer(cast(IO[bytes], tail), write_size=CHUNK) if zstd else tail
    try:
        for chunk in archive:
            out.write(chunk)
            check.write(chunk)
        if zstd:
            check.flush()
    except zstandard.ZstdError:
        return False
    out.flush()
    return tail.tail == _END


def import_command(args: argparse.Namespace, config: Config) -> int:
    started = time.monotonic()
    try:
        source: IO[bytes] = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")
    except OSError as exc:
        return fail(f"cannot read {args.file}: {exc.strerror}", EXIT_USAGE)
    try:
        with source, _connect(config.socket) as sock:
            result = rawstream.import_(sock, iter(lambda: source.read(CHUNK), b""))
    except RpcError as exc:
        return fail(str(exc), EXIT_FAILURE if exc.code == _REFUSED else EXIT_USAGE)
    except (DaemonUnreachable, OSError) as exc:
        return fail(str(exc), EXIT_USAGE)
    _say(args, {"user": result["user"], "files": result["files"], "bytes": result["bytes"],
                "seconds": round(time.monotonic() - started, 3), "warnings": result.get("warnings", [])}, "imported")
    for warning in result.get("warnings", []):
        print(f"sandboxd: {warning}", file=sys.stderr)
    return EXIT_OK
