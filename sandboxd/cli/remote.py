"""How a client command reaches its daemon: the local socket, or another host's cluster listener.

``--node-address HOST:PORT`` dials that host's ``cluster.listen`` with the certificate of the
configuration's ``cluster.tls`` (an operator's, for the operator's commands) and checks the
host shows a ``node:`` certificate the cluster's CA signed (cluster/dial.py). What the
certificate may call there is its role's (docs/security.md, "The cluster listener").
"""

from __future__ import annotations

import argparse

from sandboxd.async_client import AsyncClient
from sandboxd.client import DaemonUnreachable
from sandboxd.cluster.dial import connect_node, split_address
from sandboxd.config import Config


def add_node_address(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node-address", metavar="HOST:PORT",
                        help="reach the daemon of another host through its cluster listener (its cluster.advertise), "
                             "with the certificate of this config's cluster.tls; default: the local socket")


def check_node_address(args: argparse.Namespace, config: Config) -> str | None:
    """Why ``--node-address`` cannot be used with ``config`` (a usage error), or None."""
    if args.node_address is None:
        return None
    try:
        split_address(args.node_address)
    except ValueError as exc:
        return f"--node-address: {exc}"
    if config.cluster is None:
        return ("--node-address needs the cluster's certificates: a cluster: section with tls (cert, key, ca) in the "
                "configuration (--config; docs/install.md, \"Certificates\")")
    return None


async def open_daemon(args: argparse.Namespace, config: Config) -> AsyncClient:
    """The daemon's client: over ``--node-address`` (checked by check_node_address first), else the socket.
    DaemonUnreachable says why not."""
    if args.node_address is None:
        return await AsyncClient.connect(config.socket)
    if config.cluster is None:
        raise DaemonUnreachable("--node-address needs a cluster: section with tls in the configuration")
    return await connect_node(args.node_address, config.cluster.tls)
