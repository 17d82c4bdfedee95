"""`sandboxd storage free`: the operator's one command for a user over their disk quota (docs/install.md)."""

from __future__ import annotations

import argparse

from sandboxd.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, fail, user_argument
from sandboxd.config import Config
from sandboxd.errors import UnsafeMount
from sandboxd.storage.free import LISTED, NotAPath, held, host_path, remove
from sandboxd.storage.quota import OVER_RECHECK_S, size_text


def add_commands(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    storage = subparsers.add_parser("storage", help="a user's disk usage against their quota",
                                    description="A user's disk usage against their quota (storage.*).")
    commands = storage.add_subparsers(dest="storage_command", metavar="COMMAND", required=True)
    free = commands.add_parser(
        "free", parents=[parent], help="list what holds the most in a user's folders, or remove it",
        description=f"Without PATH: the {LISTED} entries of USER's folders that hold the most, with the command "
                    "that removes each. With PATH (as a sandbox sees it, e.g. /officer/user/cache): remove those "
                    "files or folders, never following a link, then show what the user holds. A user refused "
                    f"for being over quota is served again within {OVER_RECHECK_S:g} s of being under it. Run it "
                    "as root or as the daemon's user. Exit status: 0 under quota, 1 still over it, 2 usage.")
    free.add_argument("user", type=user_argument, metavar="USER", help="the user (an email address)")
    free.add_argument("paths", nargs="*", metavar="PATH", help="what to remove, as /officer/user/... or /officer/data/...")
    free.set_defaults(handler=free_command)


def free_command(args: argparse.Namespace, config: Config) -> int:
    try:
        for path in args.paths:  # every one checked before any is removed
            host_path(config, args.user, path)
    except NotAPath as exc:
        return fail(str(exc), EXIT_USAGE)
    for path in args.paths:
        try:
            removed = remove(config, args.user, path)
        except UnsafeMount:
            return fail(f"{path}: a folder on the way is a symbolic link (a tool may have made it), never followed; "
                        "nothing was removed there. Remove the link itself, the first folder that is one")
        except OSError as exc:
            return fail(f"could not remove {path}: {exc}")
        print(f"removed {path}" if removed else f"{path}: not there")
    return _show(config, args.user, listing=not args.paths)


def _show(config: Config, user: str, *, listing: bool) -> int:
    now = held(config, user)
    usage = now.usage
    more = "" if usage.complete else "+"
    print(f"{user} holds {size_text(usage.bytes)}{more} of {size_text(now.limit_bytes)} (storage.quota_bytes) and "
          f"{usage.inodes}{more} of {now.limit_inodes} files and folders (storage.quota_inodes)")
    if usage.unreadable is not None:
        print(f"unreadable to this user, so not counted: {usage.unreadable}")
    if listing:
        for path, size in usage.biggest:
            print(f"{size_text(size):>10}  {path}    (sandboxd storage free {user} {path})")
    over = usage.bytes > now.limit_bytes or usage.inodes > now.limit_inodes
    return EXIT_FAILURE if over else EXIT_OK
