"""`sandboxd router`: one unix socket in front of every host of a cluster (docs/scale.md, "The router")."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from sandboxd.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, fail
from sandboxd.cli.serve_cmds import event_loop_factory
from sandboxd.config import Config
from sandboxd.logging import configure_logging, set_log_budget


def add_commands(subparsers: argparse._SubParsersAction, parent: argparse.ArgumentParser) -> None:
    p = subparsers.add_parser(
        "router", parents=[parent], help="serve one socket in front of every host of a cluster",
        description="Listen on a unix socket with the same rules as `serve` (socket, socket_mode, socket_group, "
                    "allowed_uids, allowed_gids) and forward each call to its user's host over the hosts' mutual-TLS "
                    "listeners, as the cluster's directory in etcd says (the config's cluster: section, without "
                    "node, with a router:NAME certificate). Runs until SIGTERM or SIGINT; several may run side by "
                    "side. Exit status: 0 stopped, 1 the socket or etcd failed, 2 usage or configuration. "
                    "See docs/scale.md.",
    )
    p.add_argument("--socket", type=Path, metavar="PATH", help="unix socket to listen on")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.set_defaults(handler=run_router)


def run_router(args: argparse.Namespace, config: Config) -> int:
    from sandboxd.cluster.directory import Directory, DirectoryUnavailable
    from sandboxd.router.server import serve
    from sandboxd.router.view import ClusterView, tls_dial

    cluster = config.cluster
    if cluster is None:
        return fail("the router needs the config's cluster: section (etcd and tls, without node); see "
                    "docs/scale.md, \"The router\".", EXIT_USAGE)
    if cluster.node is not None:
        return fail(f"cluster.node is {cluster.node!r}: that names a host, and a router is none; leave node out of "
                    "the router's config.", EXIT_USAGE)
    configure_logging(config.log_level, config.log_format)
    set_log_budget(config.log_rate, config.log_burst)
    dial = tls_dial(cluster.tls)  # ConfigError (exit 2) names an unreadable certificate

    async def run() -> None:
        view = ClusterView(Directory(cluster))
        try:
            await view.start()
            await serve(config, view, dial)
        finally:
            await view.close()

    try:
        with asyncio.Runner(loop_factory=event_loop_factory(config.event_loop)) as runner:
            runner.run(run())
    except DirectoryUnavailable as exc:
        return fail(f"{exc.message} Start etcd, or fix cluster.etcd.", EXIT_FAILURE)
    except OSError as exc:
        return fail(str(exc), EXIT_FAILURE)
    return EXIT_OK
