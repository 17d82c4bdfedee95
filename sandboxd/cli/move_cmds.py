"""The operator's moves: `sandboxd users move USER --to NODE`, `users rehome USER --to NODE` (off a dead host),
`sandboxd nodes drain NODE` and `nodes undrain NODE`.

They read and write the directory in etcd and dial the hosts' cluster listeners with the
certificate of the `cluster:` section of --config (an operator's, `node` left out). Results
(a line per user moved) go to stdout, errors to stderr. Exit status: 0 done, 1 a move failed
(the user stays where they were, served) or etcd or a host did not answer, 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any, Awaitable, Callable

from sandboxd.async_client import AsyncClient
from sandboxd.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, fail, user_argument
from sandboxd.config import Config
from sandboxd.errors import SandboxdError

DEFAULT_WAIT_S = 60.0


def add_commands(node_commands: argparse._SubParsersAction, user_commands: argparse._SubParsersAction,
                 parent: argparse.ArgumentParser) -> None:
    moving = user_commands.add_parser(
        "move", parents=[parent], help="move USER to another host, with their files, tools and email database",
        description="Mark USER moving (their new calls are refused `moving`; calls in flight finish, up to --wait), "
                    "have host NODE pull their export from their host and check every file's sha256, then name NODE "
                    "their home in one transaction. A move that fails at any step leaves the user where they were, "
                    "served, and says which step and why. Stop the user's mail sync first (docs/scale.md, \"Moves "
                    "and drains\"). Exit status: 0 moved, 1 not moved or etcd or a host unreachable, 2 usage.")
    moving.add_argument("user", type=user_argument, metavar="USER", help="the user (an email address)")
    target = moving.add_mutually_exclusive_group(required=True)
    target.add_argument("--to", metavar="NODE", help="the host to move them to (sandboxd nodes list)")
    target.add_argument("--abort", action="store_true", help="end a move whose operator died: the user active on "
                        "their host again")
    _flags(moving)
    moving.set_defaults(handler=move_command)

    rehoming = user_commands.add_parser(
        "rehome", parents=[parent], help="name NODE the home of USER, whose host is down, without their data",
        description="For a user whose home host is dead (its lease expired; `users where` says down): name NODE "
                    "their home in one transaction that holds only while the dead host has no lease, so it cannot "
                    "serve them meanwhile. Their data stays on the dead host: restore a backup on NODE first with "
                    "`sandboxd users import` (docs/scale.md, \"When a host fails\"), or they start empty. "
                    "Exit status: 0 rehomed, 1 not (their host is up, NODE is not active, the record changed) or "
                    "etcd unreachable, 2 usage.")
    rehoming.add_argument("user", type=user_argument, metavar="USER", help="the user (an email address)")
    rehoming.add_argument("--to", metavar="NODE", required=True, help="the active host to serve them from now")
    rehoming.add_argument("--json", action="store_true", help="print {user, from, to, epoch}")
    rehoming.set_defaults(handler=rehome_command)

    draining = node_commands.add_parser(
        "drain", parents=[parent], help="place no new users on NODE and move its users to the other hosts",
        description="Mark NODE draining (no new user is placed on it; the mark outlives its restarts), then move "
                    "its users one by one to the host rendezvous hashing picks among the active ones, a line per "
                    "user. Callers of a user being moved get `moving` (a router waits). Exit status: 0 every user "
                    "moved, 1 some were not (each told; they stay on NODE, served) or etcd unreachable, 2 usage.")
    draining.add_argument("node", metavar="NODE", help="the host to drain")
    _flags(draining)
    draining.set_defaults(handler=drain_command)

    undraining = node_commands.add_parser(
        "undrain", parents=[parent], help="let new users be placed on NODE again",
        description="Clear NODE's drain mark: it is active again. Users moved off it stay where they are. "
                    "Exit status: 0, 1 NODE is not registered (the mark is cleared anyway) or etcd unreachable, 2 usage.")
    undraining.add_argument("node", metavar="NODE", help="the host")
    undraining.add_argument("--json", action="store_true", help="print {node, state, registered}")
    undraining.set_defaults(handler=undrain_command)


def _flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="S",
                   help=f"how long a user's calls in flight may take to finish before the move gives up (default "
                        f"{DEFAULT_WAIT_S:g})")
    p.add_argument("--json", action="store_true", help="print one JSON object per user moved (or not)")


def _run(config: Config, work: Callable[[Any, Any], Awaitable[int]]) -> int:
    """``work(directory, dial)`` with the cluster: section's etcd and certificate; etcd's silence is exit 1, as
    for `nodes list` (cluster_cmds.py): the command was right, the cluster did not answer."""
    from sandboxd.cluster.dial import DialFailed, connect_node
    from sandboxd.cluster.directory import Directory, DirectoryUnavailable

    cluster = config.cluster
    if cluster is None:
        return fail("no cluster: section in the configuration; pass --config with the cluster's section "
                    "(etcd, and tls with an operator:NAME certificate; node left out)", EXIT_USAGE)

    async def dial(address: str, node: str) -> AsyncClient:
        return await connect_node(address, cluster.tls, node=node)

    async def run() -> int:
        directory = Directory(cluster)
        try:
            return await work(directory, dial)
        finally:
            try:
                await directory.close()
            except SandboxdError:
                pass  # the work's answer stands

    try:
        return asyncio.run(run())
    except (DirectoryUnavailable, DialFailed) as exc:
        return fail(str(getattr(exc, "message", exc)), EXIT_FAILURE)


def _say(args: argparse.Namespace, line: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(line), flush=True)
    elif line.get("ok", True):
        print(f"moved {line['user']} from {line['from']} to {line['to']} in {line['seconds']} s "
              f"({line['files']} files, {line['bytes']} bytes)", flush=True)
    else:
        print(f"not moved {line['user']} ({line['from']} to {line['to']}): {line['error']}", flush=True)


def move_command(args: argparse.Namespace, config: Config) -> int:
    from sandboxd.cluster.move import MoveFailed, abort, move

    async def work(directory: Any, dial: Any) -> int:
        try:
            if args.abort:
                back = await abort(directory, args.user)
                print(json.dumps(back.to_json()) if args.json else f"{args.user} is active on {back.node} again")
                return EXIT_OK
            moved = await move(directory, dial, args.user, args.to, wait_s=args.wait)
        except MoveFailed as exc:
            if args.json:
                print(json.dumps({"user": args.user, "ok": False, "step": exc.step, "error": exc.message}))
            return fail(exc.message, EXIT_FAILURE)
        _say(args, {**moved.to_json(), "ok": True})
        return EXIT_OK

    return _run(config, work)


def rehome_command(args: argparse.Namespace, config: Config) -> int:
    from sandboxd.cluster.move import MoveFailed, rehome

    async def work(directory: Any, _dial: Any) -> int:
        try:
            old, new = await rehome(directory, args.user, args.to)
        except MoveFailed as exc:
            return fail(exc.message, EXIT_FAILURE)
        if args.json:
            print(json.dumps({"user": args.user, "from": old.node, "to": new.node, "epoch": new.epoch}))
        else:
            print(f"{args.user} is served by {new.node} now (epoch {new.epoch}); their data stays on {old.node}")
        return EXIT_OK

    return _run(config, work)


def drain_command(args: argparse.Namespace, config: Config) -> int:
    from sandboxd.cluster.drain import DrainRefused, drain

    async def work(directory: Any, dial: Any) -> int:
        try:
            failed = await drain(directory, dial, args.node, wait_s=args.wait, told=lambda line: _say(args, line))
        except DrainRefused as exc:
            return fail(exc.message, EXIT_FAILURE)
        if failed:
            return fail(f"{len(failed)} users stay on {args.node} (told above): {', '.join(failed)}; it is draining, "
                        "so it takes no new ones. Drain again once the cause is fixed.", EXIT_FAILURE)
        print(f"{args.node} is drained: it holds no users and takes no new ones", file=sys.stderr)
        return EXIT_OK

    return _run(config, work)


def undrain_command(args: argparse.Namespace, config: Config) -> int:
    from sandboxd.cluster.drain import undrain

    async def work(directory: Any, _dial: Any) -> int:
        registered = await undrain(directory, args.node)
        if args.json:
            print(json.dumps({"node": args.node, "state": "active", "registered": registered}))
        else:
            print(f"{args.node} is active: new users may be placed on it" if registered else
                  f"{args.node} is not registered; its drain mark is cleared, so it starts active")
        return EXIT_OK if registered else EXIT_FAILURE

    return _run(config, work)
