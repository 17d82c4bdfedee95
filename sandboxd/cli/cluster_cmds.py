"""The operator's view of the directory in etcd: `sandboxd nodes list` and `sandboxd users where USER`.

They read etcd directly with the `cluster:` section of --config (its `node` may be absent): no
daemon is asked, so they answer while a host is down. Exit status: 0, 1 etcd did not answer, 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from sandboxd.cli import move_cmds
from sandboxd.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, fail, user_argument
from sandboxd.config import Config


def add_commands(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    nodes = subparsers.add_parser("nodes", help="the hosts registered in the cluster's directory",
                                  description="The hosts of the cluster (the cluster: section of --config).")
    node_commands = nodes.add_subparsers(dest="nodes_command", metavar="COMMAND", required=True)
    listing = node_commands.add_parser(
        "list", parents=[parent], help="every registered host: its state, address and users",
        description="Every host registered in etcd now (a host whose lease expired is gone from the list), "
                    "with its state, the address others dial and how many users it holds. "
                    "Exit status: 0, 1 etcd did not answer, 2 usage.")
    listing.add_argument("--json", action="store_true", help="print {nodes: [{node, state, address, users}]}")
    listing.set_defaults(handler=nodes_list)

    users = subparsers.add_parser("users", help="one user as a unit: where they live",
                                  description="One user of the cluster (the cluster: section of --config).")
    user_commands = users.add_subparsers(dest="users_command", metavar="COMMAND", required=True)
    where = user_commands.add_parser(
        "where", parents=[parent], help="the host that serves USER, and their epoch",
        description="The user's record in the directory: their home host, its address, the epoch and whether "
                    "they are being moved. A user with no record has no home yet: the first host asked claims "
                    "them. Exit status: 0, 1 etcd did not answer, 2 usage.")
    where.add_argument("user", type=user_argument, metavar="USER", help="the user (an email address)")
    where.add_argument("--json", action="store_true", help="print {user, node, epoch, state, to, address, up}")
    where.set_defaults(handler=users_where)
    move_cmds.add_commands(node_commands, user_commands, parent)  # users move, nodes drain and undrain


def _read(config: Config) -> Any:
    """The directory as it is now (one range read), or an exit status after saying why on stderr."""
    from sandboxd.cluster.directory import Directory, DirectoryUnavailable

    cluster = config.cluster
    if cluster is None:
        return fail("no cluster: section in the configuration; pass --config with the cluster's section "
                    "(etcd, tls; node may be left out)", EXIT_USAGE)

    async def read() -> Any:
        directory = Directory(cluster)
        try:
            return await directory.snapshot()
        finally:
            await asyncio.shield(_close(directory))

    try:
        return asyncio.run(read())
    except DirectoryUnavailable as exc:
        return fail(exc.message, EXIT_FAILURE)


async def _close(directory: Any) -> None:
    try:
        await directory.close()
    except Exception:  # noqa: BLE001 - the answer is had; a connection that will not close is not the user's problem
        pass


def nodes_list(args: argparse.Namespace, config: Config) -> int:
    snapshot = _read(config)
    if isinstance(snapshot, int):
        return snapshot
    held: dict[str, int] = {}
    for record in snapshot.users.values():
        held[record.node] = held.get(record.node, 0) + 1
    rows = [{"node": name, "state": node.state, "address": node.address, "users": held.get(name, 0)}
            for name, node in sorted(snapshot.nodes.items())]
    if args.json:
        print(json.dumps({"nodes": rows}))
        return EXIT_OK
    if not rows:
        print("no host is registered (none runs with this cluster: section, or their leases expired)")
    for row in rows:
        print(f"{row['node']:<20} {row['state']:<9} {row['address'] or '-':<30} {row['users']} users")
    return EXIT_OK


def users_where(args: argparse.Namespace, config: Config) -> int:
    snapshot = _read(config)
    if isinstance(snapshot, int):
        return snapshot
    record = snapshot.users.get(args.user)
    node = None if record is None else snapshot.nodes.get(record.node)
    answer = {"user": args.user, "node": None, "epoch": None, "state": None, "to": None,
              **({} if record is None else record.to_json()),
              "address": None if node is None else node.address, "up": node is not None}
    if args.json:
        print(json.dumps(answer))
    elif record is None:
        print(f"{args.user} has no home host yet: the first host asked claims them")
    else:
        moving = f", moving to {record.to}" if record.state == "moving" else ""
        up = f"at {node.address or '(no listener)'}" if node is not None else "which is down (its lease expired)"
        print(f"{args.user}: host {record.node} {up}, epoch {record.epoch}{moving}")
    return EXIT_OK
